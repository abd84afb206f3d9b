"""A streaming, Criteo-shaped synthetic click data set with a planted signal.

Each sample has 13 dense features and 26 single-id sparse features whose ids follow a
Zipf-like (log-uniform) law over Criteo-Kaggle-like cardinalities, scaled by
``cardinality_scale``. The label is drawn from a hidden logistic model in which every
``(feature, id)`` pair has its own effect (derived from a hash, so nothing is stored) and
the dense features a linear one; the sparse part carries most of the signal, so a model
that ignores the embeddings scores a clearly lower AUC.

Batches are generated on the fly from ``(seed, batch index)``: deterministic, never
materialised, and any rank can generate its own shard.

Example::

    >>> data = SyntheticCriteo(batch_size=512, cardinality_scale=1e-3, seed=0)
    >>> batch = data.batch(0)
    >>> batch.sparse_features.keys()[:2], batch.dense_features.shape, batch.labels.shape
    (['cat_0', 'cat_1'], torch.Size([512, 13]), torch.Size([512]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, List, Sequence

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES
from robe_torchrec.hashing import HashMode, block_starts, hash_params

NUM_DENSE = 13
_EFFECT_RESOLUTION = 1 << 20


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
    """

    batch_size: int = 512
    cardinality_scale: float = 1e-3
    seed: int = 0
    sparse_signal: float = 2.0
    dense_signal: float = 0.4
    bias: float = -1.0
    num_sparse: int = 26

    def __post_init__(self) -> None:
        self.cardinalities: List[int] = [
            max(2, int(c * self.cardinality_scale)) for c in CRITEO_KAGGLE_CARDINALITIES[: self.num_sparse]
        ]
        self.keys: List[str] = [f"cat_{i}" for i in range(self.num_sparse)]
        g = torch.Generator().manual_seed(10_000 + self.seed)
        self._dense_weights = torch.randn(NUM_DENSE, generator=g) * self.dense_signal
        self._hash_params = hash_params(HashMode.MIX, 7919 + self.seed)

    def id_effects(self, feature: "int | torch.Tensor", ids: torch.Tensor) -> torch.Tensor:
        """The hidden model's effect of each id of ``feature`` (or of a feature index tensor
        broadcast against ``ids``), flattened: roughly N(0, 1), from a hash."""
        keys = (ids.to(torch.int64) * 64 + feature).reshape(-1)
        u = block_starts(keys, 2, _EFFECT_RESOLUTION, 1, HashMode.MIX, self._hash_params)
        u = (u.to(torch.float64) + 0.5) / _EFFECT_RESOLUTION
        # Box-Muller from two independent uniforms
        normal = torch.sqrt(-2 * torch.log(u[:, 0])) * torch.cos(2 * math.pi * u[:, 1])
        return normal.to(torch.float32)

    def hidden_logit(self, batch: Batch, sparse: bool = True) -> torch.Tensor:
        """The hidden model's logit of each sample of ``batch`` (its labels were drawn from
        ``sigmoid`` of it); ``sparse=False`` leaves out the id effects: the best any model
        that ignores the sparse features can do."""
        logit = torch.full((batch.labels.numel(),), self.bias) + \
            batch.dense_features @ self._dense_weights
        if sparse:
            sparse_scale = self.sparse_signal / math.sqrt(len(self.cardinalities))
            # one id per bag, features in key order: the values are a [features, batch] grid,
            # hashed in one call (the per-feature sums keep their order, so the labels too)
            values, lengths = batch.sparse_features.values(), batch.sparse_features.lengths()
            if lengths.numel() != len(self.keys) * batch.labels.numel() or \
                    not bool((lengths == 1).all()):
                raise ValueError(f"hidden_logit takes this stream's batches (one id per bag and "
                                 f"feature): got {values.numel()} ids in {lengths.numel()} bags "
                                 f"for {batch.labels.numel()} samples x {len(self.keys)} features")
            ids = values.view(len(self.keys), -1)
            features = torch.arange(len(self.keys)).unsqueeze(1)
            effects = self.id_effects(features, ids).view_as(ids)
            for row in effects:
                logit += sparse_scale * row
        return logit

    def batch(self, index: int) -> Batch:
        """Batch number ``index`` of the stream (the same for every call)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        b = self.batch_size
        dense = torch.randn(b, NUM_DENSE, generator=g)
        ids = []
        for n in self.cardinalities:
            u = torch.rand(b, generator=g, dtype=torch.float64)
            ids.append((torch.exp(u * math.log(n + 1)) - 1).floor().clamp_(0, n - 1).to(torch.int64))
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.cat(ids),
            lengths=torch.ones(b * len(self.keys), dtype=torch.int32),
        )
        batch = Batch(dense_features=dense, sparse_features=kjt, labels=torch.empty(b))
        batch.labels = torch.bernoulli(torch.sigmoid(self.hidden_logit(batch)), generator=g)
        return batch

    def batches(self, start: int = 0, count: int | None = None) -> Iterator[Batch]:
        index = start
        while count is None or index < start + count:
            yield self.batch(index)
            index += 1

    def table_sizes(self) -> Sequence[int]:
        return list(self.cardinalities)
