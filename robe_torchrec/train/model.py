"""The app's model: built from its Hydra config's :class:`robe_torchrec.dlrm.DLRMSpec`
(:func:`robe_torchrec.train.config.dlrm_spec`), TorchRec's planner and DMP for sharding, and
the optimizers the pipeline steps and the checkpoints hold.

Example::

    >>> model, summary = build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
    >>> dmp = shard(model, cfg, torch.device("cpu"))
    >>> dense, optimizer = build_optimizer(cfg, dmp)   # optimizer: dense + dmp.fused_optimizer
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from robe_torchrec.compress import fit_from_checkpoint
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder, robe_sharding_constraints
from robe_torchrec.dlrm import EmbeddingSummary, build_dlrm, dense_optimizer
from robe_torchrec.dlrm import build_predict_model as _build_predict_model
from robe_torchrec.train.checkpoint import CheckpointError, verify_checkpoint
# dlrm_spec, optimizer_spec: the config as the model's spec, checked (imported from here too)
from robe_torchrec.train.config import ConfigError, dlrm_spec, optimizer_spec  # noqa: F401


def build_model(cfg: DictConfig, keys: Sequence[str], cardinalities: Sequence[int],
                device: torch.device) -> Tuple[DLRMTrain, EmbeddingSummary]:
    """The config's DLRMTrain, unsharded (see :func:`robe_torchrec.dlrm.build_dlrm`);
    ``embedding.init_from``: its ROBE array is the least-squares fit of the full tables of
    that checkpoint (:mod:`robe_torchrec.compress`)."""
    model, summary = build_dlrm(dlrm_spec(cfg), keys, cardinalities, dense_device=device)
    source = cfg.embedding.get("init_from")  # robe only
    if source:
        # the same checks as a resume: manifest, checksums, metadata read without running code
        problem = verify_checkpoint(source, cfg.run.allow_unverified)
        if problem is not None:
            raise CheckpointError(f"embedding.init_from={source} is unusable: {problem}")
        fit_from_checkpoint(model.model.sparse_arch.embedding_bag_collection, source)
    return model, summary


def build_predict_model(cfg: DictConfig, keys: Sequence[str], cardinalities: Sequence[int]
                        ) -> Tuple[nn.Module, EmbeddingSummary]:
    """The config's unsharded ``DLRM`` / ``DLRM_DCN`` on CPU, without the loss wrapper (see
    :func:`robe_torchrec.dlrm.build_predict_model`): what the app exports."""
    return _build_predict_model(dlrm_spec(cfg), keys, cardinalities)


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
    # the last sharder of a module type wins: ours, offering row_wise when the config asks
    row_wise = "row_wise" in (cfg.sharding.types or [])
    sharders = [*get_default_sharders(), RobeEmbeddingBagCollectionSharder(row_wise=row_wise)]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type,
                        local_world_size=local_world)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=_constraints(model, cfg))
    plan = planner.collective_plan(model, sharders, pg)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=device,
                                    plan=plan, sharders=sharders)


def build_optimizer(cfg: DictConfig, dmp: DistributedModelParallel
                    ) -> Tuple[KeyedOptimizerWrapper, CombinedOptimizer]:
    """The dense optimizer (everything not fused into backward), for the pipeline to step,
    and it combined with ``dmp.fused_optimizer`` (whose update runs inside backward): one
    KeyedOptimizer holding every optimizer state, for the checkpoints."""
    opt = dlrm_spec(cfg).dense_optimizer
    dense = dense_optimizer(dmp, opt.cls, opt.kwargs())
    return dense, CombinedOptimizer([("dense", dense), ("embedding", dmp.fused_optimizer)])


__all__ = ["build_model", "build_optimizer", "build_predict_model", "dense_optimizer", "dlrm_spec", "optimizer_spec",
           "shard"]
