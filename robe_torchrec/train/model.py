"""Build the model: embeddings (ROBE-Z or full), DLRM / DLRM_DCN, DMP sharding, optimizers.

Example::

    >>> model, summary = build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
    >>> dmp = shard(model, cfg, torch.device("cpu"))
    >>> dense, optimizer = build_optimizer(cfg, dmp)   # optimizer: dense + dmp.fused_optimizer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple, Type

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.data.synthetic import NUM_DENSE
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder, robe_sharding_constraints
from robe_torchrec.interaction import use_fast_interaction
from robe_torchrec.train.config import ConfigError

#: the ``optimizer.name`` values and their torch.optim classes (fused or dense)
OPTIMIZERS: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


@dataclass
class EmbeddingSummary:
    """What is printed at start: the embedding memory and the compression."""

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


def optimizer_kwargs(opt: DictConfig, lr: float) -> Dict[str, Any]:
    """torch.optim keyword arguments of an ``optimizer`` config group entry."""
    kwargs: Dict[str, Any] = {"lr": lr, "weight_decay": opt.get("weight_decay", 0.0)}
    if opt.name in ("adagrad", "adam"):
        kwargs["eps"] = opt.eps
    if opt.name == "adam":
        kwargs["betas"] = tuple(opt.betas)
    return kwargs


def embedding_tables(keys: Sequence[str], cardinalities: Sequence[int], dim: int
                     ) -> List[EmbeddingBagConfig]:
    """One table ``t_<key>`` per feature."""
    return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=int(n),
                               feature_names=[k]) for k, n in zip(keys, cardinalities)]


def build_embeddings(emb: DictConfig, keys: Sequence[str], cardinalities: Sequence[int]
                     ) -> Tuple[nn.Module, EmbeddingSummary]:
    """The ``embedding`` config group as a module (unsharded, on CPU)."""
    tables = embedding_tables(keys, cardinalities, emb.dim)
    uncompressed = sum(t.num_embeddings * t.embedding_dim for t in tables)
    if emb.kind == "full":
        return EmbeddingBagCollection(tables), EmbeddingSummary("full", uncompressed, uncompressed)
    robe = RobeConfig(compression=emb.compression, memory_size=emb.memory_size,
                      block_size=emb.block_size, hash=emb.hash, seed=emb.seed, shared=emb.shared)
    ebc = RobeEmbeddingBagCollection(tables, robe)
    return ebc, EmbeddingSummary(f"ROBE-Z, Z={emb.block_size}, {emb.hash} hash, "
                                 f"{'shared' if emb.shared else 'per-table'}",
                                 ebc.uncompressed_size, ebc.memory_size)


def build_model(cfg: DictConfig, keys: Sequence[str], cardinalities: Sequence[int],
                device: torch.device) -> Tuple[DLRMTrain, EmbeddingSummary]:
    """DLRMTrain(DLRM or DLRM_DCN) with its embedding optimizer fused into backward.

    Call with the same ``torch.manual_seed`` on every rank: unsharded weights are the
    starting point of every rank's shards."""
    ebc, summary = build_embeddings(cfg.embedding, keys, cardinalities)
    opt = cfg.optimizer
    # fused into backward: ROBE's own kernel, or FBGEMM's TBE for the full tables
    apply_optimizer_in_backward(OPTIMIZERS[opt.name], list(ebc.parameters()),
                                optimizer_kwargs(opt, opt.embedding_lr))
    m = cfg.model
    common = dict(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                  dense_arch_layer_sizes=list(m.dense_arch_layer_sizes),
                  over_arch_layer_sizes=list(m.over_arch_layer_sizes), dense_device=device)
    if m.name == "dcn":
        model = DLRM_DCN(dcn_num_layers=m.dcn_num_layers, dcn_low_rank_dim=m.dcn_low_rank_dim,
                         **common)
    else:
        model = DLRM(**common)
        if m.get("fast_interaction", False):
            use_fast_interaction(model)
    return DLRMTrain(model), summary


def _constraints(model: nn.Module, cfg: DictConfig) -> Dict[str, ParameterConstraints]:
    types = list(cfg.sharding.types) if cfg.sharding.types else None
    if cfg.embedding.kind == "robe" and cfg.embedding.shared:
        if types and set(types) - {"data_parallel", "row_wise"}:
            raise ConfigError(
                f"sharding.types={types}: a shared ROBE array (embedding.shared=true) cannot be "
                "split by table; use data_parallel or row_wise, or embedding.shared=false")
        # all tables of the shared array must be planned alike
        base = {n: ParameterConstraints(sharding_types=types) for n in _table_names(model)} \
            if types else None
        return robe_sharding_constraints(model, base)
    if not types and cfg.embedding.kind == "full":
        # a data-parallel TorchRec table is a dense parameter trained by the dense optimizer
        # (not the fused one, nor with embedding_lr), which FusedSparseDist and SemiSync
        # cannot pipeline: let the planner choose among the model-parallel types
        types = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
    if not types:
        return {}
    return {n: ParameterConstraints(sharding_types=types) for n in _table_names(model)}


def _table_names(model: nn.Module) -> List[str]:
    ebc = model.model.sparse_arch.embedding_bag_collection
    return [t.name for t in ebc.embedding_bag_configs()]


def shard(model: DLRMTrain, cfg: DictConfig, device: torch.device) -> DistributedModelParallel:
    """Plan (TorchRec's planner, collectively) and wrap in DistributedModelParallel."""
    pg = dist.group.WORLD
    sharders = [RobeEmbeddingBagCollectionSharder(), *get_default_sharders()]
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type,
                        local_world_size=_local_world_size())
    planner = EmbeddingShardingPlanner(topology=topology, constraints=_constraints(model, cfg))
    plan = planner.collective_plan(model, sharders, pg)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=device,
                                    plan=plan, sharders=sharders)


def _local_world_size() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def build_optimizer(cfg: DictConfig, dmp: DistributedModelParallel
                    ) -> Tuple[KeyedOptimizerWrapper, CombinedOptimizer]:
    """The dense optimizer (everything not fused into backward), for the pipeline to step,
    and it combined with ``dmp.fused_optimizer`` (whose update runs inside backward): one
    KeyedOptimizer holding every optimizer state, for the checkpoints."""
    opt = cfg.optimizer
    dense = dense_optimizer(dmp, OPTIMIZERS[opt.name], optimizer_kwargs(opt, opt.dense_lr))
    return dense, CombinedOptimizer([("dense", dense), ("embedding", dmp.fused_optimizer)])


def dense_optimizer(dmp: nn.Module, cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any]
                    ) -> KeyedOptimizerWrapper:
    """``cls(**kwargs)`` over every parameter not updated by an optimizer fused into backward."""
    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                 lambda params: cls(params, **kwargs))
