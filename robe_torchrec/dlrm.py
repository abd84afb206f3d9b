"""The one DLRM builder: TorchRec's ``DLRMTrain`` around ``DLRM`` or ``DLRM_DCN``, on ROBE-Z
(or TorchRec's full) embedding tables, with the embedding optimizer fused into backward.

The training app (``robe_torchrec.train``), the pipeline comparison (``robe_torchrec.pipelines.compare``)
and the tests describe their model as a :class:`DLRMSpec` and build it here, so they all
train the same model. Sharding is left to the caller (the app plans with TorchRec's planner,
the pipeline tests give an explicit per-table plan).

Example::

    >>> spec = DLRMSpec(robe=RobeConfig(compression=1000, block_size=8), embedding_dim=16,
    ...                 dense_arch=(64, 16), over_arch=(64, 32, 1),
    ...                 embedding_optimizer=OptimizerSpec("adagrad", lr=0.05),
    ...                 dense_optimizer=OptimizerSpec("sgd", lr=0.1))
    >>> torch.manual_seed(0)                 # the same on every rank: shards start alike
    >>> model, summary = build_dlrm(spec, data.keys, data.cardinalities)
    >>> dmp = DistributedModelParallel(model, ...)
    >>> dense = dense_optimizer(dmp, spec.dense_optimizer.cls, spec.dense_optimizer.kwargs())
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec.config import RobeConfig
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.interaction import use_fast_interaction

#: optimizer names and their torch.optim classes (fused into backward, or dense)
OPTIMIZERS: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
#: the interaction of :class:`DLRMSpec.model`: TorchRec's dot product, or DCN-v2
MODELS = ("dlrm", "dcn")
#: the default of :attr:`DLRMSpec.dense_in_features`: Criteo's 13 integer features. The model
#: owns its input width; the data modules keep the format's own constant
#: (``robe_torchrec.data.criteo.NUM_DENSE``), and a test checks the two agree.
CRITEO_DENSE_IN_FEATURES = 13


@dataclass(frozen=True)
class OptimizerSpec:
    """A ``torch.optim`` optimizer by name; settings left ``None`` keep torch's defaults.

    Example::

        >>> OptimizerSpec("adam", lr=1e-3, betas=(0.9, 0.999)).kwargs()
        {'lr': 0.001, 'betas': (0.9, 0.999)}
    """

    name: str = "adagrad"
    lr: float = 0.05
    weight_decay: Optional[float] = None
    eps: Optional[float] = None
    betas: Optional[Tuple[float, float]] = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimizerSpec: unknown optimizer {self.name!r}; choose one of "
                             f"{', '.join(OPTIMIZERS)}")

    @property
    def cls(self) -> Type[torch.optim.Optimizer]:
        return OPTIMIZERS[self.name]

    def kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of ``cls`` (``lr`` and the settings that are not None)."""
        out: Dict[str, Any] = {"lr": self.lr}
        for key in ("weight_decay", "eps", "betas"):
            if getattr(self, key) is not None:
                out[key] = tuple(self.betas) if key == "betas" else getattr(self, key)
        return out


@dataclass(frozen=True)
class DLRMSpec:
    """What :func:`build_dlrm` builds.

    Args:
        robe: the ROBE-Z compression of the tables; ``None``: TorchRec's full
            ``EmbeddingBagCollection`` (the uncompressed baseline).
        embedding_dim: the dimension of every table.
        model: ``"dlrm"`` (dot interaction) or ``"dcn"`` (``DLRM_DCN``'s low-rank cross net).
        dense_arch: layer sizes of the dense MLP; the last is ``embedding_dim``.
        over_arch: layer sizes of the top MLP; the last is 1 (the logit).
        dcn_num_layers, dcn_low_rank_dim: the cross network of ``model="dcn"``.
        fast_interaction: ``model="dlrm"`` only: swap in
            :class:`robe_torchrec.interaction.FastInteractionArch` (same output, faster on CPU).
        embedding_optimizer: fused into backward (ROBE's kernel, or FBGEMM's TBE once sharded).
        dense_optimizer: for every other parameter; see :func:`dense_optimizer`.
        dense_in_features: how many dense features the model takes (TorchRec's ``DLRM``
            argument of that name); Criteo's 13 by default, as every data source here has.
    """

    robe: Optional[RobeConfig] = RobeConfig(compression=1000, block_size=8)
    embedding_dim: int = 16
    model: str = "dlrm"
    dense_arch: Tuple[int, ...] = (64, 16)
    over_arch: Tuple[int, ...] = (64, 32, 1)
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 16
    fast_interaction: bool = False
    embedding_optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    dense_optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    dense_in_features: int = CRITEO_DENSE_IN_FEATURES

    def __post_init__(self) -> None:
        # tuples, so a spec built from a YAML list compares and hashes like any other
        object.__setattr__(self, "dense_arch", tuple(int(n) for n in self.dense_arch))
        object.__setattr__(self, "over_arch", tuple(int(n) for n in self.over_arch))
        if self.model not in MODELS:
            raise ValueError(f"DLRMSpec.model must be one of {MODELS}, got {self.model!r}")
        if not self.dense_arch or self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(f"DLRMSpec.dense_arch must end at embedding_dim "
                             f"({self.embedding_dim}), got {self.dense_arch}")
        if not self.over_arch or self.over_arch[-1] != 1:
            raise ValueError(f"DLRMSpec.over_arch must end at 1, got {self.over_arch}")
        if self.dense_in_features < 1:
            raise ValueError(f"DLRMSpec.dense_in_features must be >= 1 (the width of the "
                             f"batches' dense_features), got {self.dense_in_features}")
        if self.fast_interaction and self.model != "dlrm":
            raise ValueError("DLRMSpec.fast_interaction needs model='dlrm'")

    @property
    def kind(self) -> str:
        """``"robe"`` or ``"full"``."""
        return "full" if self.robe is None else "robe"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DLRMSpec":
        """A spec from plain nested data (a YAML config): ``robe`` and the optimizers are
        dicts of :class:`RobeConfig` / :class:`OptimizerSpec` fields.

        Example::

            >>> DLRMSpec.from_dict({"robe": {"compression": 100}, "embedding_dim": 8,
            ...                     "dense_arch": [16, 8], "over_arch": [16, 1],
            ...                     "dense_optimizer": {"name": "sgd", "lr": 0.1}})
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"DLRMSpec: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        values = dict(d)
        if values.get("robe") is not None:
            values["robe"] = RobeConfig(**values["robe"])
        for key in ("embedding_optimizer", "dense_optimizer"):
            if key in values:
                values[key] = OptimizerSpec(**values[key])
        return cls(**values)


@dataclass
class EmbeddingSummary:
    """The embedding memory and the compression (printed when a run starts)."""

    kind: str
    uncompressed_floats: int
    stored_floats: int

    @property
    def compression_ratio(self) -> float:
        return self.uncompressed_floats / self.stored_floats

    def __str__(self) -> str:
        mib = self.stored_floats * 4 / 2**20
        return (f"embeddings ({self.kind}): {self.uncompressed_floats:,} floats uncompressed, "
                f"{self.stored_floats:,} stored ({mib:,.2f} MiB), compression "
                f"{self.compression_ratio:,.1f}x")


def embedding_tables(keys: Sequence[str], cardinalities: Sequence[int], dim: int
                     ) -> List[EmbeddingBagConfig]:
    """One table ``t_<key>`` per feature."""
    return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=int(n),
                               feature_names=[k]) for k, n in zip(keys, cardinalities)]


def build_embeddings(spec: DLRMSpec, keys: Sequence[str], cardinalities: Sequence[int]
                     ) -> Tuple[nn.Module, EmbeddingSummary]:
    """The embedding module of ``spec`` (unsharded, on CPU) and its summary."""
    tables = embedding_tables(keys, cardinalities, spec.embedding_dim)
    uncompressed = sum(t.num_embeddings * t.embedding_dim for t in tables)
    robe = spec.robe
    if robe is None:
        ebc = EmbeddingBagCollection(tables, device=torch.device("cpu"))
        return ebc, EmbeddingSummary("full", uncompressed, uncompressed)
    ebc = RobeEmbeddingBagCollection(tables, robe)
    return ebc, EmbeddingSummary(f"ROBE-Z, Z={robe.block_size}, {robe.hash} hash, "
                                 f"{'shared' if robe.shared else 'per-table'}",
                                 ebc.uncompressed_size, ebc.memory_size)


def build_predict_model(spec: DLRMSpec, keys: Sequence[str], cardinalities: Sequence[int],
                        dense_device: Optional[torch.device] = None
                        ) -> Tuple[nn.Module, EmbeddingSummary]:
    """``DLRM`` or ``DLRM_DCN`` of ``spec``, unsharded, without the loss wrapper and without an
    optimizer in backward: ``model(dense_features, sparse_features)`` returns the logits
    ``[B, 1]``. The model to serve, export or quantize; its ``state_dict`` is the trained
    ``DLRMTrain``'s under ``model.``.

    Example::

        >>> model, _ = build_predict_model(spec, data.keys, data.cardinalities)
        >>> model.eval()(batch.dense_features, batch.sparse_features).shape
        torch.Size([512, 1])
    """
    ebc, summary = build_embeddings(spec, keys, cardinalities)
    common = dict(embedding_bag_collection=ebc, dense_in_features=spec.dense_in_features,
                  dense_arch_layer_sizes=list(spec.dense_arch),
                  over_arch_layer_sizes=list(spec.over_arch), dense_device=dense_device)
    if spec.model == "dcn":
        model = DLRM_DCN(dcn_num_layers=spec.dcn_num_layers,
                         dcn_low_rank_dim=spec.dcn_low_rank_dim, **common)
    else:
        model = DLRM(**common)
        if spec.fast_interaction:
            use_fast_interaction(model)
    return model, summary


def build_dlrm(spec: DLRMSpec, keys: Sequence[str], cardinalities: Sequence[int],
               dense_device: Optional[torch.device] = None
               ) -> Tuple[DLRMTrain, EmbeddingSummary]:
    """``DLRMTrain`` around :func:`build_predict_model`'s ``DLRM`` or ``DLRM_DCN``, with
    ``spec.embedding_optimizer`` applied in backward to the embeddings.

    Call with the same ``torch.manual_seed`` on every rank: the unsharded weights are the
    starting point of every rank's shards. ``dense_device``: where the dense layers are
    created (CPU by default; DistributedModelParallel moves them anyway)."""
    model, summary = build_predict_model(spec, keys, cardinalities, dense_device)
    opt = spec.embedding_optimizer
    apply_optimizer_in_backward(opt.cls, list(model.sparse_arch.embedding_bag_collection
                                              .parameters()), opt.kwargs())
    return DLRMTrain(model), summary


def dense_optimizer(model: nn.Module, cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any]
                    ) -> KeyedOptimizerWrapper:
    """``cls(**kwargs)`` over every parameter of ``model`` (e.g. the DMP-wrapped model) not
    updated by an optimizer fused into backward: the optimizer a train pipeline steps."""
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                 lambda params: cls(params, **kwargs))
