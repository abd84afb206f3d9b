"""What the pipeline tests and the comparison runner need around the one DLRM builder
(:func:`robe_torchrec.dlrm.build_dlrm`): an explicit plan with one sharding type for every
table, the model wrapped in ``DistributedModelParallel`` with its dense optimizer, and the
full state of a sharded model to compare runs with.

Call inside an initialised process group (e.g. a rank of ``tests.distributed.multiprocess``).

Example::

    >>> data = SyntheticCriteo(batch_size=64, cardinality_scale=1e-3, num_sparse=4)
    >>> dmp, dense_opt = build_sharded_dlrm(DLRMSpec(), data, sharding="table_wise")
    >>> pipeline = make_pipeline("sparse_dist", dmp, dense_opt, torch.device("cpu"))
    >>> travel_diff(gather_state(dmp), reference, initial)   # 0.0: the same weights
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

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
from torchrec.optim.keyed import KeyedOptimizerWrapper

from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
from robe_torchrec.dlrm import DLRMSpec, build_dlrm, dense_optimizer

EBC_FQN = "model.sparse_arch.embedding_bag_collection"
#: the sharding types :func:`build_sharded_dlrm` gives every table
SHARDINGS = ("data_parallel", "table_wise", "row_wise")


def sharding_plan(ebc: nn.Module, sharding: str, world: int, sharder, device_type: str) -> Dict:
    """The plan of ``ebc`` with every table sharded as ``sharding`` (table-wise: table ``i``
    on rank ``i % world``)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; choose one of {', '.join(SHARDINGS)}")
    per_table = {}
    for i, table in enumerate(ebc.embedding_bag_configs()):
        if sharding == "data_parallel":
            per_table[table.name] = data_parallel()
        elif sharding == "table_wise":
            per_table[table.name] = table_wise(rank=i % world)
        else:
            per_table[table.name] = row_wise()
    return construct_module_sharding_plan(ebc, per_param_sharding=per_table, sharder=sharder,
                                          local_size=world, world_size=world,
                                          device_type=device_type)


def build_sharded_dlrm(spec: DLRMSpec, data: SyntheticCriteo, sharding: str = "data_parallel",
                       device: torch.device = torch.device("cpu"), seed: int = 0
                       ) -> Tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """``spec``'s model for ``data``'s features (initial weights from ``torch.manual_seed(
    seed)``), every table sharded as ``sharding``, and its dense optimizer
    (``spec.dense_optimizer``)."""
    torch.manual_seed(seed)
    model, _ = build_dlrm(spec, data.keys, data.cardinalities)
    world = dist.get_world_size()
    sharder = (RobeEmbeddingBagCollectionSharder() if spec.kind == "robe"
               else EmbeddingBagCollectionSharder())
    ebc = model.model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({EBC_FQN: sharding_plan(ebc, sharding, world, sharder, device.type)})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=device, plan=plan, sharders=[sharder])
    opt = spec.dense_optimizer
    return dmp, dense_optimizer(dmp, opt.cls, opt.kwargs())


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
