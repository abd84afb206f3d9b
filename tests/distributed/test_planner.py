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
from robe_torchrec.distributed import (
    RobeEmbeddingBagCollectionSharder,
    get_default_sharders,
    robe_sharding_constraints,
)
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection

GB = 1024**3
BIG_ROWS, DIM = 10**9, 64


def _tables(suffix: str = ""):
    return [EmbeddingBagConfig(name="big" + suffix, embedding_dim=DIM, num_embeddings=BIG_ROWS,
                               feature_names=["f_big" + suffix]),
            EmbeddingBagConfig(name="small" + suffix, embedding_dim=DIM, num_embeddings=10**6,
                               feature_names=["f_small" + suffix])]


class _Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.sparse = ebc


def _robe_model(shared: bool = False, optimizer=torch.optim.Adagrad, suffix: str = "") -> _Model:
    ebc = RobeEmbeddingBagCollection(_tables(suffix), RobeConfig(compression=1000, shared=shared,
                                                           block_size=32), device="meta")
    apply_optimizer_in_backward(optimizer, [ebc.weight], {"lr": 0.1})
    return _Model(ebc)


def _topology() -> Topology:
    # 4 GiB of memory per rank: the uncompressed big table alone is 238 GiB
    return Topology(world_size=2, compute_device="cpu", ddr_cap=4 * GB)


def test_storage_estimate_is_the_compressed_size():
    model = _robe_model()
    sharder = RobeEmbeddingBagCollectionSharder(row_wise=True)  # every type the module has
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


@pytest.mark.parametrize("row_wise", [False, True])
def test_enumerated_types_are_per_module(row_wise):
    # a shared and a per-table module side by side: each is offered its own types
    model = nn.Sequential(_robe_model(shared=True, suffix="_a"), _robe_model(suffix="_b"))
    options = EmbeddingEnumerator(topology=_topology(), batch_size=512).enumerate(
        model, [RobeEmbeddingBagCollectionSharder(row_wise=row_wise)])
    rw = {"row_wise"} if row_wise else set()
    assert {o.sharding_type for o in options if o.name.endswith("_a")} == (
        rw or {"data_parallel"})
    assert {o.sharding_type for o in options if o.name.endswith("_b")} == (
        {"data_parallel", "table_wise"} | rw)


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


# --- no constraints: every plan the planner makes keeps the unsharded model's numerics -----

CRITEO_SCALE = 1e-4  # tiny tables (2 to 1013 rows): the planner is what is under test


def _criteo_dlrm(shared: bool):
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.dlrm import DLRMSpec, build_dlrm

    data = SyntheticCriteo(batch_size=2 * 3, cardinality_scale=CRITEO_SCALE, seed=0)
    spec = DLRMSpec(robe=RobeConfig(compression=10, block_size=4, shared=shared),
                    embedding_dim=8, dense_arch=(8, 8), over_arch=(8, 1))
    torch.manual_seed(0)
    model, _ = build_dlrm(spec, data.keys, data.cardinalities)
    return model, data


def _valid_default_types(shared: bool):
    return {"data_parallel"} if shared else {"data_parallel", "table_wise"}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shared", [False, True], ids=["per_table", "shared"])
def test_unconstrained_planner_keeps_the_unsharded_numerics(shared, world):
    model, _ = _criteo_dlrm(shared)
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu")).plan(
        model, get_default_sharders())
    types = {ps.sharding_type for ps in plan.get_plan_for_module(
        "model.sparse_arch.embedding_bag_collection").values()}
    assert types <= _valid_default_types(shared), types


@pytest.mark.parametrize("shared", [False, True], ids=["per_table", "shared"])
def test_row_wise_only_when_asked(shared):
    model = _robe_model(shared=shared)
    planner = EmbeddingShardingPlanner(topology=_topology(), batch_size=512)
    default = planner.plan(model, [RobeEmbeddingBagCollectionSharder()])
    assert "row_wise" not in {ps.sharding_type for ps in default.get_plan_for_module("sparse").values()}
    constraints = robe_sharding_constraints(
        model, {n: ParameterConstraints(sharding_types=["row_wise"]) for n in ("big", "small")})
    asked = EmbeddingShardingPlanner(topology=_topology(), batch_size=512,
                                     constraints=constraints).plan(
        model, [RobeEmbeddingBagCollectionSharder(row_wise=True)])
    assert {ps.sharding_type for ps in asked.get_plan_for_module("sparse").values()} == {"row_wise"}


def test_invalid_plan_error_names_the_fixes():
    from robe_torchrec.distributed.sharder import validate_plan
    from torchrec.distributed.types import ParameterSharding

    model = _robe_model(shared=True)
    plan = {"big": ParameterSharding("table_wise", "fused", ranks=[0]),
            "small": ParameterSharding("data_parallel", "fused")}
    with pytest.raises(ValueError) as err:
        validate_plan(model.sparse, plan)
    assert "robe_sharding_constraints(model)" in str(err.value)
    assert "RobeConfig(shared=False)" in str(err.value)


def _train_criteo(rank: int, world: int):
    """Per layout: the plan DMP makes by itself, and the worst gap to the unsharded model of
    the logits of two steps (the second after one update)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from robe_torchrec.dlrm import dense_optimizer
    from tests.distributed.common import local_slice

    out = {}
    for shared in (False, True):
        model, data = _criteo_dlrm(shared)
        dmp = DistributedModelParallel(model)  # DMP's own planner, the default sharders
        types = {ps.sharding_type for ps in dmp.plan.get_plan_for_module(
            "model.sparse_arch.embedding_bag_collection").values()}
        opt = dense_optimizer(dmp, torch.optim.SGD, {"lr": 0.1})
        ref, _ = _criteo_dlrm(shared)
        ref_opt = dense_optimizer(ref, torch.optim.SGD, {"lr": 0.1})
        local = data.batch_size // world
        lo, hi = rank * local, (rank + 1) * local
        worst = 0.0
        for step in range(2):
            batch = data.batch(step)
            mine = type(batch)(dense_features=batch.dense_features[lo:hi],
                               sparse_features=local_slice(batch.sparse_features, rank, local),
                               labels=batch.labels[lo:hi])
            loss, (_, logits, _) = dmp(mine)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss, (_, ref_logits, _) = ref(batch)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            worst = max(worst, (logits.detach() - ref_logits[lo:hi].detach()).abs().max().item())
        out[shared] = (sorted(types), worst)
    dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_criteo_dlrm_dmp_defaults_train_as_unsharded(world):
    from tests.distributed.multiprocess import run_ranks

    for per_layout in run_ranks(_train_criteo, world):
        for shared, (types, worst) in per_layout.items():
            assert set(types) <= _valid_default_types(shared), (shared, types)
            assert worst <= 1e-5, (shared, world, worst)
