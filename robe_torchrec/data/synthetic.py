"""A streaming, Criteo-shaped synthetic click data set with a planted signal.

Each sample has 13 dense features and 26 single-id sparse features; the label is drawn from
a hidden logistic model whose per-id parameters are derived from a hash (nothing is stored).
Two modes (``mode=``):

* ``"realistic"``: per-feature power-law id popularity, ``P(id = r - 1) ~ r ** -s`` over
  ``N`` ids, with ``s`` and ``N`` fitted on 10,000 real Criteo rows
  (docs/data.md; the fit's script is in benchmarks/results/probes/); ``N`` scales with
  ``cardinality_scale / 0.01``. The hidden logit is a dense linear part, per-id effects
  whose spread falls with the id's rarity, and a rank-4 latent-factor interaction between
  every pair of features (each id's factor vector shrinks with rarity too), with the
  intercept set so that the click rate is ``click_rate`` (Criteo Kaggle: about 0.25).
* ``"hard"`` (the default of this class, kept bit for bit for old results): log-uniform ids
  over Criteo-Kaggle cardinalities times ``cardinality_scale``, and an independent effect
  for every ``(feature, id)`` pair plus a linear dense part: a signal with no structure for
  a compressed table to share.

In both, the sparse part carries most of the signal, so a model that ignores the embeddings
scores a clearly lower AUC.

Batches are generated on the fly from ``(seed, batch index)``: deterministic, never
materialised, and any rank can generate its own shard.

Example::

    >>> data = SyntheticCriteo(batch_size=512, cardinality_scale=1e-3, seed=0)
    >>> batch = data.batch(0)
    >>> batch.sparse_features.keys()[:2], batch.dense_features.shape, batch.labels.shape
    (['cat_0', 'cat_1'], torch.Size([512, 13]), torch.Size([512]))
    >>> SyntheticCriteo(mode="realistic", cardinality_scale=0.01).cardinalities[:3]
    [359, 416, 63774]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES
from robe_torchrec.data.criteo import NUM_DENSE  # the Criteo format's, defined once there
from robe_torchrec.hashing import HashMode, block_starts, hash_params

_EFFECT_RESOLUTION = 1 << 20
MODES = ("realistic", "hard")

#: realistic mode, fitted on the 10,000 real rows (docs/data.md): power-law
#: exponent and number of ids of each feature (the ids at ``cardinality_scale=0.01``)
FITTED_EXPONENTS: List[float] = [
    1.8, 1.256, 0.881, 0.878, 2.406, 2.545, 0.687, 2.125, 6.578, 0.692, 0.775, 0.898, 0.815,
    2.677, 0.848, 0.909, 1.083, 1.035, 1.125, 0.702, 0.908, 3.568, 2.035, 0.979, 2.185, 0.945,
]
FITTED_CARDINALITIES: List[int] = [
    359, 416, 63774, 13881, 141, 8, 4286, 262, 3, 3882, 2473, 61381, 1977, 26, 2609, 36707,
    9, 1452, 584, 4, 52726, 8, 12, 6122, 41, 2918,
]
_FITTED_SCALE = 0.01
#: realistic mode's hidden model: rank of the interaction factors, spreads of the dense part,
#: the per-id effects and the factors, and how fast an id's parameters shrink with its
#: popularity rank r (a factor r ** -RARITY_DECAY: rare ids act like their feature's average)
LATENT_RANK = 4
DENSE_SIGNAL = 0.6
EFFECT_SIGNAL = 2.0
LATENT_SIGNAL = 1.5
RARITY_DECAY = 0.25
_CALIBRATION_SAMPLES = 2048


@dataclass
class SyntheticCriteo:
    """Synthetic Criteo-like batches (see module docstring).

    Args:
        batch_size: samples per batch.
        cardinality_scale: multiplies every Criteo cardinality (at least 2 ids remain).
        seed: selects the hidden model and the sample stream.
        sparse_signal: scale of the per-id effects in the hidden logit.
        dense_signal: scale of the dense effects in the hidden logit.
        bias: intercept of the hidden logit (sets the click rate).
        num_sparse: how many of the 26 sparse features to use.
        mode: ``"realistic"`` or ``"hard"`` (module docstring); ``sparse_signal``,
            ``dense_signal`` and ``bias`` are the hard mode's, ``click_rate`` the realistic's.
        click_rate: the realistic mode's mean click probability (its intercept is solved
            for it on a calibration sample).
    """

    batch_size: int = 512
    cardinality_scale: float = 1e-3
    seed: int = 0
    sparse_signal: float = 2.0
    dense_signal: float = 0.4
    bias: float = -1.0
    num_sparse: int = 26
    mode: str = "hard"
    click_rate: float = 0.25

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: choose one of {MODES}")
        if not 0 < self.click_rate < 1:
            raise ValueError(f"click_rate={self.click_rate}: must lie strictly between 0 and 1")
        if not 1 <= self.num_sparse <= len(CRITEO_KAGGLE_CARDINALITIES):
            raise ValueError(f"num_sparse={self.num_sparse}: must be 1 to "
                             f"{len(CRITEO_KAGGLE_CARDINALITIES)}")
        self.keys: List[str] = [f"cat_{i}" for i in range(self.num_sparse)]
        g = torch.Generator().manual_seed(10_000 + self.seed)
        self._hash_params = hash_params(HashMode.MIX, 7919 + self.seed)
        if self.mode == "hard":
            self.cardinalities: List[int] = [
                max(2, int(c * self.cardinality_scale))
                for c in CRITEO_KAGGLE_CARDINALITIES[: self.num_sparse]]
            self._dense_weights = torch.randn(NUM_DENSE, generator=g) * self.dense_signal
            return
        self.cardinalities = [
            min(cap, max(2, round(n * self.cardinality_scale / _FITTED_SCALE)))
            for n, cap in zip(FITTED_CARDINALITIES[: self.num_sparse], CRITEO_KAGGLE_CARDINALITIES)]
        self._dense_weights = torch.randn(NUM_DENSE, generator=g) * (
            DENSE_SIGNAL / math.sqrt(NUM_DENSE))
        # inverse-CDF sampling of each feature's power law (float64: the tail's steps are tiny)
        self._cdfs = []
        for n, s in zip(self.cardinalities, FITTED_EXPONENTS):
            p = torch.arange(1, n + 1, dtype=torch.float64).pow(-s)
            self._cdfs.append(torch.cumsum(p / p.sum(), 0))
        self.bias = 0.0
        # a fixed sample, whatever the batch size, so the stream does not depend on it
        calibration = self._sample(-1, _CALIBRATION_SAMPLES, labels=False)
        self.bias = _intercept_for(self.hidden_logit(calibration), self.click_rate)

    @property
    def num_dense(self) -> int:
        """The width of every batch's ``dense_features`` (Criteo's 13): what a model built
        for this data takes as ``dense_in_features``."""
        return NUM_DENSE

    def id_effects(self, feature: "int | torch.Tensor", ids: torch.Tensor) -> torch.Tensor:
        """The hidden model's effect of each id of ``feature`` (or of a feature index tensor
        broadcast against ``ids``), flattened: roughly N(0, 1), from a hash."""
        keys = (ids.to(torch.int64) * 64 + feature).reshape(-1)
        u = block_starts(keys, 2, _EFFECT_RESOLUTION, 1, HashMode.MIX, self._hash_params)
        u = (u.to(torch.float64) + 0.5) / _EFFECT_RESOLUTION
        # Box-Muller from two independent uniforms
        normal = torch.sqrt(-2 * torch.log(u[:, 0])) * torch.cos(2 * math.pi * u[:, 1])
        return normal.to(torch.float32)

    def _id_normals(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` independent standard normals per entry of the ``[features, batch]`` id
        grid ``ids``, ``[count, features, batch]``, from the hash (the realistic mode's
        per-id parameters: effect, then factors)."""
        features = torch.arange(ids.shape[0]).unsqueeze(1)
        keys = (ids.to(torch.int64) * 64 + features).reshape(-1)
        u = block_starts(keys, 2 * count, _EFFECT_RESOLUTION, 1, HashMode.MIX,
                         self._hash_params)
        u = ((u.to(torch.float64) + 0.5) / _EFFECT_RESOLUTION).T.reshape(2, count, *ids.shape)
        return (torch.sqrt(-2 * torch.log(u[0])) * torch.cos(2 * math.pi * u[1])).float()

    def _realistic_sparse_logit(self, ids: torch.Tensor) -> torch.Tensor:
        """Per-id effects plus the pairwise factor interactions of an ``[features, batch]``
        id grid; every id's parameters shrink by ``rank ** -RARITY_DECAY``."""
        normals = self._id_normals(ids, 1 + LATENT_RANK)
        shrink = (ids.to(torch.float32) + 1).pow(-RARITY_DECAY)
        num_features = ids.shape[0]
        effects = (EFFECT_SIGNAL / math.sqrt(num_features)) * (shrink * normals[0]).sum(0)
        factors = shrink * normals[1:]                        # [rank, features, batch]
        # sum over feature pairs f < g of <v_f, v_g>, from the square of the sum
        pairs = 0.5 * (factors.sum(1).pow(2) - factors.pow(2).sum(1)).sum(0)
        num_pairs = max(1, num_features * (num_features - 1) // 2)
        return effects + (LATENT_SIGNAL / math.sqrt(num_pairs * LATENT_RANK)) * pairs

    def hidden_logit(self, batch: Batch, sparse: bool = True) -> torch.Tensor:
        """The hidden model's logit of each sample of ``batch`` (its labels were drawn from
        ``sigmoid`` of it); ``sparse=False`` leaves out the id effects: the best any model
        that ignores the sparse features can do."""
        logit = torch.full((batch.labels.numel(),), self.bias) + \
            batch.dense_features @ self._dense_weights
        if sparse:
            # one id per bag, features in key order: the values are a [features, batch] grid,
            # hashed in one call (the per-feature sums keep their order, so the labels too)
            values, lengths = batch.sparse_features.values(), batch.sparse_features.lengths()
            if lengths.numel() != len(self.keys) * batch.labels.numel() or \
                    not bool((lengths == 1).all()):
                raise ValueError(f"hidden_logit takes this stream's batches (one id per bag and "
                                 f"feature): got {values.numel()} ids in {lengths.numel()} bags "
                                 f"for {batch.labels.numel()} samples x {len(self.keys)} features")
            ids = values.view(len(self.keys), -1)
            if self.mode == "realistic":
                return logit + self._realistic_sparse_logit(ids)
            sparse_scale = self.sparse_signal / math.sqrt(len(self.cardinalities))
            features = torch.arange(len(self.keys)).unsqueeze(1)
            effects = self.id_effects(features, ids).view_as(ids)
            for row in effects:
                logit += sparse_scale * row
        return logit

    def batch(self, index: int) -> Batch:
        """Batch number ``index`` of the stream (the same for every call)."""
        return self._sample(index, self.batch_size)

    def _sample(self, index: int, b: int, labels: bool = True) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        dense = torch.randn(b, NUM_DENSE, generator=g)
        ids = []
        for f, n in enumerate(self.cardinalities):
            u = torch.rand(b, generator=g, dtype=torch.float64)
            if self.mode == "realistic":
                ids.append(torch.searchsorted(self._cdfs[f], u).clamp_(max=n - 1))
                continue
            ids.append((torch.exp(u * math.log(n + 1)) - 1).floor().clamp_(0, n - 1).to(torch.int64))
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.cat(ids),
            lengths=torch.ones(b * len(self.keys), dtype=torch.int32),
        )
        batch = Batch(dense_features=dense, sparse_features=kjt, labels=torch.empty(b))
        if labels:
            batch.labels = torch.bernoulli(torch.sigmoid(self.hidden_logit(batch)), generator=g)
        return batch

    def batches(self, start: int = 0, count: int | None = None) -> Iterator[Batch]:
        index = start
        while count is None or index < start + count:
            yield self.batch(index)
            index += 1

    def table_sizes(self) -> Sequence[int]:
        return list(self.cardinalities)


def _intercept_for(logits: torch.Tensor, rate: float) -> float:
    """The ``b`` with ``mean(sigmoid(logits + b)) == rate`` (bisection: the mean rises with b)."""
    lo, hi = -20.0, 20.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if torch.sigmoid(logits.double() + mid).mean() < rate else (lo, mid)
    return (lo + hi) / 2
