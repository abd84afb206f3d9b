"""Optimizer integration and checkpoints of a sharded RobeEmbeddingBagCollection:
``dmp.fused_optimizer`` keys, LR changes, ``in_backward_optimizer_filter``, state dicts,
torch.distributed.checkpoint save on 2 ranks (TABLE_WISE) and load on 1 (DATA_PARALLEL) and
3 (ROW_WISE + TABLE_WISE + DATA_PARALLEL),
unsharded <-> sharded state dicts, layout mismatch and unsupported plans refused clearly."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec import RobeConfig
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

GLOBAL_BATCH = 12
ROBE = RobeConfig(compression=10, block_size=4, shared=False)
ADAGRAD = (torch.optim.Adagrad, {"lr": 0.1})
TW = {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"}
DP = {"t0": "data_parallel", "t1": "data_parallel", "t2": "data_parallel"}
MIXED = {"t0": "row_wise", "t1": "table_wise", "t2": "data_parallel"}


def _step(dmp, rank: int, world: int, step: int) -> None:
    """One training step on the same global batch whatever the world size (the loss is
    scaled so the rank-averaged gradient is the global batch's mean)."""
    local = GLOBAL_BATCH // world
    kjt = common.global_batch(step, 1, GLOBAL_BATCH)
    tgt = common.target(step, GLOBAL_BATCH, 24)[rank * local: (rank + 1) * local]
    out = dmp(common.local_slice(kjt, rank, local))
    (((out - tgt) ** 2).sum() * world / GLOBAL_BATCH).backward()


def _state(dmp):
    dmp.fused_optimizer.save_param_groups(True)  # TorchRec leaves LR out by default
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _arrays(dmp):
    st = dmp.fused_optimizer.state_dict()["state"]["ebc.weight"]
    return (common.full_weight(dmp), common.full_tensor(st["sum"]), float(st["step"]))


def _save(rank, world, ckpt):
    dmp = common.make_dmp(ROBE, TW, world, optimizer=ADAGRAD, ranks={"t0": 0, "t1": 1, "t2": 0})
    # keys as TorchRec keys its own (module path + parameter name)
    assert list(dmp.fused_optimizer.params) == ["ebc.weight"]
    assert set(dmp.state_dict()) == {"ebc.weight", "ebc.robe_layout"}
    assert not [n for n, _ in in_backward_optimizer_filter(dmp.named_parameters())]
    assert [n for n, _ in dmp.named_parameters()]  # the arrays are parameters, filtered out

    # LR through param_groups: 0 freezes the arrays, restoring it trains again
    w0 = common.full_weight(dmp)
    dmp.fused_optimizer.param_groups[0]["lr"] = 0.0
    _step(dmp, rank, world, 100)
    assert torch.equal(common.full_weight(dmp), w0)
    dmp.fused_optimizer.param_groups[0]["lr"] = 0.1
    _step(dmp, rank, world, 101)
    assert not torch.equal(common.full_weight(dmp), w0)

    for step in range(3):
        _step(dmp, rank, world, step)
    state = _state(dmp)
    assert float(state["optim"]["state"]["ebc.weight"]["step"]) == 5.0
    assert state["optim"]["param_groups"][0]["lr"] == 0.1
    dcp.save(state, checkpoint_id=ckpt)
    before = _arrays(dmp)
    _step(dmp, rank, world, 3)
    after = _arrays(dmp)
    if rank == 0:
        torch.save({"before": before, "after": after}, os.path.join(ckpt, "..", "arrays.pt"))


def _load(rank, world, ckpt, types, ranks):
    dmp = common.make_dmp(ROBE, types, world, optimizer=ADAGRAD, ranks=ranks, seed=123)
    dmp.fused_optimizer.param_groups[0]["lr"] = 0.5  # the checkpoint's 0.1 must come back
    state = _state(dmp)
    dcp.load(state, checkpoint_id=ckpt)
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])
    ref = torch.load(os.path.join(ckpt, "..", "arrays.pt"))
    w, s, step = _arrays(dmp)
    assert torch.equal(w, ref["before"][0]) and torch.equal(s, ref["before"][1])
    assert step == ref["before"][2] == 5.0
    assert dmp.fused_optimizer.param_groups[0]["lr"] == 0.1
    _step(dmp, rank, world, 3)  # TW/DP: continues exactly as the 2-rank run did
    w, s, step = _arrays(dmp)
    return ((w - ref["after"][0]).abs().max().item(), (s - ref["after"][1]).abs().max().item(),
            step, (w - ref["before"][0]).abs().max().item())


def _single_rank(rank, world, ckpt):
    # the unsharded module's state dict loads into a sharded one, and back
    unsharded = common.make_ebc(ROBE, seed=5)
    dmp = common.make_dmp(ROBE, TW, world, optimizer=ADAGRAD)
    dmp.load_state_dict({"ebc." + k: v for k, v in unsharded.state_dict().items()})
    assert torch.equal(common.full_weight(dmp), unsharded.weight.detach())
    dmp_dp = common.make_dmp(ROBE, DP, world, optimizer=ADAGRAD, seed=9)
    back = common.make_ebc(ROBE, seed=11)
    back.load_state_dict({k[len("ebc."):]: v for k, v in dmp_dp.state_dict().items()})
    assert torch.equal(back.weight.detach(), common.full_weight(dmp_dp))
    assert not torch.equal(back.weight.detach(), common.make_ebc(ROBE, seed=11).weight.detach())

    # another hash seed: same sizes, so DCP reads it, and load_state_dict must refuse
    other = RobeConfig(compression=10, block_size=4, shared=False, seed=7)
    dmp = common.make_dmp(other, DP, world, optimizer=ADAGRAD)
    state = _state(dmp)
    dcp.load(state, checkpoint_id=ckpt)
    with pytest.raises(ValueError, match="another ROBE layout.*seed: checkpoint 1024 vs module 7"):
        dmp.load_state_dict(state["model"])
    # unsupported sharding types in a plan
    from torchrec.distributed.sharding_plan import column_wise
    from torchrec.distributed.types import ShardingEnv
    from robe_torchrec.distributed import ShardedRobeEmbeddingBagCollection
    from robe_torchrec.distributed.sharder import RobeEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    ebc = common.make_ebc(ROBE)
    sharder = RobeEmbeddingBagCollectionSharder(fused_params={"optimizer": None})
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding={"t0": column_wise(ranks=[0]), "t1": table_wise(rank=0),
                                 "t2": table_wise(rank=0)},
        local_size=1, world_size=1, device_type="cpu", sharder=sharder)
    with pytest.raises(ValueError, match="table 't0' is planned column_wise, which ROBE "
                                         "sharding does not support"):
        ShardedRobeEmbeddingBagCollection(ebc, plan, env, (torch.optim.SGD, {"lr": 0.1}))
    shared = common.make_ebc(RobeConfig(compression=10, block_size=4, shared=True))
    plan = construct_module_sharding_plan(
        shared, per_param_sharding={n: table_wise(rank=0) for n in ("t0", "t1", "t2")},
        local_size=1, world_size=1, device_type="cpu", sharder=sharder)
    with pytest.raises(ValueError, match="shared=True.*cannot be split by table"):
        ShardedRobeEmbeddingBagCollection(shared, plan, env, (torch.optim.SGD, {"lr": 0.1}))
    # no fused optimizer anywhere
    with pytest.raises(ValueError, match="needs a fused optimizer"):
        common.make_dmp(ROBE, DP, world)
    return True


@pytest.fixture(scope="session")  # see tests/conftest.py: built once per worker
def checkpoint(tmp_path_factory):
    """Trained and saved (DCP) on 2 ranks, TABLE_WISE; also checks keys, LR and filter."""
    ckpt = str(tmp_path_factory.mktemp("robe_dcp") / "ckpt")
    run_ranks(_save, 2, ckpt)
    return ckpt


def _check_load(ckpt, world, types, ranks):
    for w_diff, s_diff, step, moved in run_ranks(_load, world, ckpt, types, ranks):
        assert step == 6.0 and moved > 1e-3
        if "row_wise" not in types.values():
            assert w_diff <= 1e-5 and s_diff <= 1e-5, (world, w_diff, s_diff)
        # (ROW_WISE hashes a table's rows into per-rank slices: the same arrays, loaded
        # exactly, are another function from there on)


@pytest.mark.slow
def test_save_on_2_load_on_1_data_parallel(checkpoint):
    _check_load(checkpoint, 1, DP, None)


@pytest.mark.slow
def test_save_on_2_load_on_3_mixed_row_table_data_parallel(checkpoint):
    _check_load(checkpoint, 3, MIXED, {"t1": 2})


@pytest.mark.slow
def test_unsharded_round_trip_layout_mismatch_and_bad_plans(checkpoint):
    assert run_ranks(_single_rank, 1, checkpoint) == [True]
