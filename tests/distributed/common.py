"""Shared pieces of the distributed tests (run inside spawned ranks)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec import RobeConfig
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection

B = 4  # local batch


def tables() -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=500,
                           feature_names=["f1", "f2"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
    ]


FEATURES = ["f0", "f1", "f2", "f3"]
ROWS = {"f0": 1000, "f1": 500, "f2": 500, "f3": 300}


def make_ebc(robe: RobeConfig, seed: int = 0, device=None,
             is_weighted: bool = False) -> RobeEmbeddingBagCollection:
    torch.manual_seed(seed)
    return RobeEmbeddingBagCollection(tables(), robe, is_weighted=is_weighted, device=device)


def global_batch(step: int, world: int, batch: int = B, weighted: bool = False) -> KeyedJaggedTensor:
    """The same global batch (``world * batch`` samples) on every rank (with per-sample
    weights if ``weighted``)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world * batch
    lengths, values = [], []
    for f in FEATURES:
        lens = torch.randint(0, 4, (n,), generator=g)
        lengths.append(lens)
        values.append(torch.randint(0, ROWS[f], (int(lens.sum()),), generator=g))
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, values, torch.cat(lengths), weights)


def local_slice(kjt: KeyedJaggedTensor, rank: int, batch: int = B) -> KeyedJaggedTensor:
    """Samples ``[rank * batch, (rank + 1) * batch)`` of a KJT."""
    n = kjt.stride()
    lengths, values, weights = [], [], []
    for f in kjt.keys():
        jt = kjt[f]
        lens = jt.lengths()
        offs = jt.offsets()
        lo, hi = rank * batch, (rank + 1) * batch
        lengths.append(lens[lo:hi])
        values.append(jt.values()[offs[lo]: offs[hi]])
        if jt.weights_or_none() is not None:
            weights.append(jt.weights()[offs[lo]: offs[hi]])
    assert n % batch == 0
    return KeyedJaggedTensor.from_lengths_sync(kjt.keys(), torch.cat(values), torch.cat(lengths),
                                               torch.cat(weights) if weights else None)


def target(step: int, rows: int, dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randn(rows, dim, generator=g)


class Wrapper(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        # a sharded EBC may order its KeyedTensor keys differently: read them by name
        kt = self.ebc(kjt).to_dict()
        return torch.cat([kt[f] for f in FEATURES], dim=1)


def plan_for(module: RobeEmbeddingBagCollection, types: Dict[str, str], world: int,
             sharder: RobeEmbeddingBagCollectionSharder, ranks: Optional[Dict[str, int]] = None):
    per_param = {}
    for name, st in types.items():
        if st == "data_parallel":
            per_param[name] = data_parallel()
        elif st == "row_wise":
            per_param[name] = row_wise()
        elif st == "table_wise":
            per_param[name] = table_wise(rank=(ranks or {}).get(name, 0))
        else:
            raise ValueError(st)
    return construct_module_sharding_plan(module, per_param_sharding=per_param, sharder=sharder,
                                          local_size=world, world_size=world, device_type="cpu")


def make_dmp(robe: RobeConfig, types: Dict[str, str], world: int, optimizer=None,
             fused_params=None, ranks=None, seed: int = 0, is_weighted: bool = False):
    ebc = make_ebc(robe, seed, is_weighted=is_weighted)
    if optimizer is not None:
        apply_optimizer_in_backward(optimizer[0], [ebc.weight], optimizer[1])
    sharder = RobeEmbeddingBagCollectionSharder(fused_params=fused_params)
    plan = ShardingPlan({"ebc": plan_for(ebc, types, world, sharder, ranks)})
    dmp = DistributedModelParallel(Wrapper(ebc), env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return dmp


def full_tensor(t) -> torch.Tensor:
    """A flat array of the state dict (plain, or ShardedTensor with each piece declared
    once), assembled on every rank (collective for a ShardedTensor)."""
    if not hasattr(t, "local_shards"):
        return t.detach().clone()
    out = torch.zeros(tuple(t.size()))
    for shard in t.local_shards():
        off, size = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        out[off: off + size] = shard.tensor
    dist.all_reduce(out)
    return out


def full_weight(dmp) -> torch.Tensor:
    """The sharded module's flat array, assembled on every rank."""
    return full_tensor(dmp.state_dict()["ebc.weight"])


def sharded_and_unsharded_step(dmp, ref: RobeEmbeddingBagCollection, rank: int, world: int,
                               step: int) -> float:
    """One training step of the sharded model on this rank's samples and of the unsharded
    module ``ref`` on the global batch (loss scaled by 1/world: the sharded gradient is the
    ranks' average); returns the largest output difference on this rank's samples."""
    kjt = global_batch(step, world)
    tgt = target(step, world * B, ref.layout.output_dim)
    lo, hi = rank * B, (rank + 1) * B
    out = dmp(local_slice(kjt, rank))
    (0.5 * ((out - tgt[lo:hi]) ** 2).sum()).backward()
    ref_out = ref(kjt).values()
    (0.5 * ((ref_out - tgt) ** 2).sum() / world).backward()
    return (out.detach() - ref_out[lo:hi].detach()).abs().max().item()


def run_cases(rank: int, world: int, run_case, names: List[str]) -> Dict[str, object]:
    """``run_case(rank, world, name)`` for every name, in one process per rank (a test module
    pays the processes' start once instead of once per case); a failure names its case."""
    results = {}
    for name in names:
        try:
            results[name] = run_case(rank, world, name)
        except Exception as exc:
            raise RuntimeError(f"case {name!r} failed on rank {rank}") from exc
    return results
