"""EmbeddingShardingPlanner with the ROBE sharder: tables are planned by their compressed
size (a 1e9-row table at 1000x is the small table it is) and constraints are honoured."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder, robe_sharding_constraints
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection

GB = 1024**3
BIG_ROWS, DIM = 10**9, 64


def _tables():
    return [EmbeddingBagConfig(name="big", embedding_dim=DIM, num_embeddings=BIG_ROWS,
                               feature_names=["f_big"]),
            EmbeddingBagConfig(name="small", embedding_dim=DIM, num_embeddings=10**6,
                               feature_names=["f_small"])]


class _Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.sparse = ebc


def _robe_model(shared: bool = False, optimizer=torch.optim.Adagrad) -> _Model:
    ebc = RobeEmbeddingBagCollection(_tables(), RobeConfig(compression=1000, shared=shared,
                                                           block_size=32), device="meta")
    apply_optimizer_in_backward(optimizer, [ebc.weight], {"lr": 0.1})
    return _Model(ebc)


def _topology() -> Topology:
    # 4 GiB of memory per rank: the uncompressed big table alone is 238 GiB
    return Topology(world_size=2, compute_device="cpu", ddr_cap=4 * GB)


def test_storage_estimate_is_the_compressed_size():
    model = _robe_model()
    sharder = RobeEmbeddingBagCollectionSharder()
    options = EmbeddingEnumerator(topology=_topology(), batch_size=512).enumerate(model, [sharder])
    compressed_bytes = model.sparse.memory_size * (BIG_ROWS * DIM) / model.sparse.uncompressed_size * 4
    seen = set()
    for option in options:
        if option.name != "big":
            continue
        seen.add(option.sharding_type)
        ddr = sum(shard.storage.ddr for shard in option.shards)
        replicas = 2 if option.sharding_type == "data_parallel" else 1
        # array + Adagrad state (x2), per replica, plus TorchRec's I/O buffers
        assert 2 * compressed_bytes * replicas <= ddr <= 2 * compressed_bytes * replicas + 0.1 * GB, (
            option.sharding_type, ddr)
    assert seen == {"data_parallel", "table_wise", "row_wise"}


def test_planner_plans_the_compressed_table():
    model = _robe_model()
    plan = EmbeddingShardingPlanner(topology=_topology(), batch_size=512).plan(
        model, [RobeEmbeddingBagCollectionSharder()])
    module_plan = plan.get_plan_for_module("sparse")
    assert set(module_plan) == {"big", "small"}
    for ps in module_plan.values():
        assert ps.sharding_type in ("data_parallel", "table_wise", "row_wise")
        assert ps.compute_kernel == "fused"


def test_uncompressed_table_does_not_fit():
    # the control: the same tables as a plain EmbeddingBagCollection cannot be planned
    ebc = EmbeddingBagCollection(_tables(), device=torch.device("meta"))
    with pytest.raises(PlannerError):
        EmbeddingShardingPlanner(topology=_topology(), batch_size=512).plan(
            _Model(ebc), [EmbeddingBagCollectionSharder()])


def test_constraints_are_honoured():
    model = _robe_model()
    constraints = {"big": ParameterConstraints(sharding_types=["table_wise"]),
                   "small": ParameterConstraints(sharding_types=["data_parallel"])}
    plan = EmbeddingShardingPlanner(topology=_topology(), batch_size=512,
                                    constraints=constraints).plan(
        model, [RobeEmbeddingBagCollectionSharder()])
    module_plan = plan.get_plan_for_module("sparse")
    assert module_plan["big"].sharding_type == "table_wise"
    assert module_plan["small"].sharding_type == "data_parallel"


def test_shared_layout_constraints_keep_tables_data_parallel():
    model = _robe_model(shared=True)
    constraints = robe_sharding_constraints(
        model, {"big": ParameterConstraints(sharding_types=["table_wise", "data_parallel"])})
    assert constraints["big"].sharding_types == ["data_parallel"]
    plan = EmbeddingShardingPlanner(topology=_topology(), batch_size=512,
                                    constraints=constraints).plan(
        model, [RobeEmbeddingBagCollectionSharder()])
    assert {ps.sharding_type for ps in plan.get_plan_for_module("sparse").values()} == {"data_parallel"}
