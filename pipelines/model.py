"""The DLRM the parity tests and the comparison runner train: ``DLRMTrain`` around a
ROBE-Z or a stock ``EmbeddingBagCollection`` on ``SyntheticCriteo`` features, wrapped in
``DistributedModelParallel`` with one sharding type for every table, plus its dense
optimizer (embeddings are updated by an optimizer fused into backward).

Call inside an initialised process group (e.g. a rank of ``tests.distributed.multiprocess``).

Example::

    >>> data = SyntheticCriteo(batch_size=64, cardinality_scale=1e-3, num_sparse=4)
    >>> dmp, dense_opt = build_dlrm(ModelSpec(kind="robe", sharding="table_wise"), data)
    >>> pipeline = make_pipeline("sparse_dist", dmp, dense_opt, torch.device("cpu"))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Tuple

import numpy as np

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper

from robe_torchrec import RobeConfig
from robe_torchrec.data.synthetic import NUM_DENSE, SyntheticCriteo
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from robe_torchrec.train.model import OPTIMIZERS, dense_optimizer, embedding_tables

EBC_FQN = "model.sparse_arch.embedding_bag_collection"


@dataclass
class ModelSpec:
    """What to build. ``kind``: ``"robe"`` or ``"stock"``; ``sharding``: ``"data_parallel"``,
    ``"table_wise"`` or ``"row_wise"`` (all tables alike); ROBE ``shared`` (one array; then
    only data_parallel/row_wise) or one array per table."""

    kind: str = "robe"
    sharding: str = "data_parallel"
    embedding_dim: int = 8
    dense_arch: List[int] = field(default_factory=lambda: [16])
    over_arch: List[int] = field(default_factory=lambda: [16])
    compression: float = 1000.0
    block_size: int = 8
    shared: bool = False
    emb_optimizer: str = "adagrad"
    emb_lr: float = 0.05
    dense_lr: float = 0.1
    dense_optimizer: str = "sgd"
    seed: int = 0


def build_unsharded(spec: ModelSpec, data: SyntheticCriteo) -> DLRMTrain:
    """The model before sharding, with the in-backward optimizer applied to its embeddings."""
    torch.manual_seed(spec.seed)
    tables = embedding_tables(data.keys, data.cardinalities, spec.embedding_dim)
    if spec.kind == "robe":
        ebc: nn.Module = RobeEmbeddingBagCollection(
            tables, RobeConfig(compression=spec.compression, block_size=spec.block_size,
                               shared=spec.shared))
    elif spec.kind == "stock":
        ebc = EmbeddingBagCollection(tables, device=torch.device("cpu"))
    else:
        raise ValueError(f"ModelSpec.kind must be 'robe' or 'stock', got {spec.kind!r}")
    apply_optimizer_in_backward(OPTIMIZERS[spec.emb_optimizer], list(ebc.parameters()),
                                {"lr": spec.emb_lr})
    dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                dense_arch_layer_sizes=[*spec.dense_arch, spec.embedding_dim],
                over_arch_layer_sizes=[*spec.over_arch, 1])
    return DLRMTrain(dlrm)


def _plan(ebc: nn.Module, spec: ModelSpec, world: int, sharder, device_type: str) -> Dict:
    per_table = {}
    for i, table in enumerate(ebc.embedding_bag_configs()):
        if spec.sharding == "data_parallel":
            per_table[table.name] = data_parallel()
        elif spec.sharding == "table_wise":
            per_table[table.name] = table_wise(rank=i % world)
        elif spec.sharding == "row_wise":
            per_table[table.name] = row_wise()
        else:
            raise ValueError(f"unknown sharding {spec.sharding!r}")
    return construct_module_sharding_plan(ebc, per_param_sharding=per_table, sharder=sharder,
                                          local_size=world, world_size=world,
                                          device_type=device_type)


def build_dlrm(spec: ModelSpec, data: SyntheticCriteo,
               device: torch.device = torch.device("cpu")
               ) -> Tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """The DMP-wrapped model and its dense optimizer (``spec.dense_optimizer``, ``dense_lr``)."""
    model = build_unsharded(spec, data)
    world = dist.get_world_size()
    sharder = (RobeEmbeddingBagCollectionSharder() if spec.kind == "robe"
               else EmbeddingBagCollectionSharder())
    ebc = model.model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({EBC_FQN: _plan(ebc, spec, world, sharder, device.type)})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=device, plan=plan, sharders=[sharder])
    return dmp, dense_optimizer(dmp, OPTIMIZERS[spec.dense_optimizer], {"lr": spec.dense_lr})


def gather_state(dmp: nn.Module) -> Dict[str, torch.Tensor]:
    """Every state-dict tensor on CPU, sharded ones assembled in full on every rank
    (collective; on the device NCCL needs when the process group is NCCL)."""
    comm = (torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl" else torch.device("cpu"))
    out: Dict[str, torch.Tensor] = {}
    for name, t in dmp.state_dict().items():
        if hasattr(t, "local_shards"):
            full = torch.zeros(tuple(t.size()), dtype=t.dtype, device=comm)
            for shard in t.local_shards():
                idx = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                            shard.metadata.shard_sizes))
                full[idx] = shard.tensor.to(comm)
            # shards are disjoint and each is declared once: a sum assembles them
            dist.all_reduce(full)
            out[name] = full.cpu()
        elif isinstance(t, torch.Tensor):
            out[name] = t.detach().cpu().clone()
    return out


def travel_diff(state: Mapping, ref: Mapping, init: Mapping) -> float:
    """How far ``state`` ended from ``ref``, as a fraction of the distance ``ref`` travelled
    from ``init``: ||state - ref|| / ||ref - init|| over the float entries (tensors or numpy
    arrays, e.g. from :func:`gather_state`)."""
    keys = [k for k in ref if np.asarray(ref[k]).dtype.kind == "f"]
    num = sum(float(((np.asarray(state[k], np.float64) - np.asarray(ref[k])) ** 2).sum())
              for k in keys)
    den = sum(float(((np.asarray(ref[k], np.float64) - np.asarray(init[k])) ** 2).sum())
              for k in keys)
    return (num / den) ** 0.5
