"""A ROBE module built on the meta device and sharded by ``DistributedModelParallel`` (which
materialises it) starts exactly where the same module built on CPU with the same seed
starts, for every sharding type; and TorchRec's ``reset_parameters`` of the sharded module
draws the same again."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

_TYPES = {
    "data_parallel": (RobeConfig(compression=10, block_size=4), {}),
    "table_wise": (RobeConfig(compression=10, block_size=4, shared=False), {}),
    "row_wise": (RobeConfig(compression=10, block_size=4), {"row_wise": True}),
}


def _meta_vs_cpu(rank: int, world: int, sharding: str):
    robe, sharder_args = _TYPES[sharding]
    direct = common.make_ebc(robe, seed=7).weight.detach().clone()

    ebc = common.make_ebc(robe, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    sharder = RobeEmbeddingBagCollectionSharder(**sharder_args)
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding])
                   for t in ebc.embedding_bag_configs()}
    planner = EmbeddingShardingPlanner(Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(common.Wrapper(ebc), [sharder])
    torch.manual_seed(7)
    dmp = DistributedModelParallel(common.Wrapper(ebc), device=torch.device("cpu"),
                                   sharders=[sharder], plan=plan)
    types = {ps.sharding_type for ps in dmp.module.ebc.module_sharding_plan.values()}
    materialised = common.full_weight(dmp)
    torch.manual_seed(7)
    dmp.module.ebc.reset_parameters()
    redrawn = common.full_weight(dmp)
    return types, torch.equal(materialised, direct), torch.equal(redrawn, direct)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", sorted(_TYPES))
def test_meta_module_sharded_by_dmp_equals_cpu_built(sharding):
    for types, materialised_ok, redrawn_ok in run_ranks(_meta_vs_cpu, 2, sharding):
        assert types == {sharding}
        assert materialised_ok and redrawn_ok
