"""Row-wise Adagrad (EXACT_ROWWISE_ADAGRAD) on a sharded module, given by fused_params,
torchrec's ``RowWiseAdagrad`` or ours: equality with the unsharded module, the fused
optimizer's checkpoint, and the plans whose state cannot be the unsharded module's
(refused)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchrec.optim
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
from robe_torchrec.distributed.sharder import validate_rowwise_state
from robe_torchrec.ops.meta import rowwise_state_size
from robe_torchrec.optim import RowWiseAdagrad
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

KWARGS = {"lr": 0.1, "eps": 1e-8}
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8}
DP = {"t0": "data_parallel", "t1": "data_parallel", "t2": "data_parallel"}
TW = {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"}
# per-table arrays 800, 200, 240: every one starts at a multiple of block_size
ALIGNED = RobeConfig(compression=10, block_size=4, shared=False)
# per-table arrays 648, 161, 193: the second ends, the third starts, mid-chunk
UNALIGNED = RobeConfig(memory_size=1002, block_size=4, shared=False)
CASES = {
    # name: (robe config, plan, optimizer, fused_params)
    "dp_fused_params": (UNALIGNED, DP, None, FUSED),  # data-parallel: any layout
    "dp_in_backward": (RobeConfig(compression=10, block_size=4, shared=True), DP,
                       (RowWiseAdagrad, KWARGS), None),
    # torchrec's own class, as a TorchRec user passes it
    "tw_aligned": (ALIGNED, TW, (torchrec.optim.RowWiseAdagrad, KWARGS), None),
}


_step = common.sharded_and_unsharded_step


def _run(rank, world, name):
    robe, types, optimizer, fused = CASES[name]
    dmp = common.make_dmp(robe, types, world, optimizer=optimizer, fused_params=fused,
                          ranks={"t0": 0, "t1": 1, "t2": 0})
    # the sharded lookups' arrays are ROBE arrays to torchrec's class too (no state there)
    assert not torchrec.optim.RowWiseAdagrad(dmp.parameters(), lr=0.1).state
    ref = common.make_ebc(robe)
    apply_optimizer_in_backward(RowWiseAdagrad, [ref.weight], KWARGS)
    worst_out = max(_step(dmp, ref, rank, world, step) for step in range(2))
    st = dmp.fused_optimizer.state_dict()["state"]["ebc.weight"]
    rows = rowwise_state_size(ref.memory_size, robe.block_size)
    assert tuple(st["sum"].size()) == (rows,) and float(st["step"]) == 2.0
    diff_w = (common.full_weight(dmp) - ref.weight.detach()).abs().max().item()
    ref_sum = ref.fused_optimizer.param_state["sum"]
    diff_s = (common.full_tensor(st["sum"]) - ref_sum).abs().max().item()
    moved = (ref.weight.detach() - common.make_ebc(robe).weight.detach()).abs().max().item()

    # checkpoint of the fused optimizer: save, train on, load back, continue as before
    saved = copy.deepcopy(dmp.fused_optimizer.state_dict())
    model = copy.deepcopy(dmp.state_dict())
    before = common.full_tensor(saved["state"]["ebc.weight"]["sum"])
    _step(dmp, ref, rank, world, 2)
    after = common.full_tensor(dmp.fused_optimizer.state_dict()["state"]["ebc.weight"]["sum"])
    assert not torch.equal(before, after)
    dmp.load_state_dict(model)
    dmp.fused_optimizer.load_state_dict(saved)
    st = dmp.fused_optimizer.state_dict()["state"]["ebc.weight"]
    assert torch.equal(common.full_tensor(st["sum"]), before) and float(st["step"]) == 2.0
    return worst_out, diff_w, diff_s, moved


@pytest.fixture(scope="module")
def results():
    """Every case's results by rank, from one pair of processes."""
    return run_ranks(common.run_cases, 2, _run, list(CASES), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_rowwise_adagrad_matches_unsharded(name, results):
    for by_case in results:
        worst_out, diff_w, diff_s, moved = by_case[name]
        assert moved > 1e-3
        assert worst_out <= 1e-5 and diff_w <= 1e-5 and diff_s <= 1e-5, \
            (worst_out, diff_w, diff_s)


def test_unaligned_arrays_are_refused():
    ebc = common.make_ebc(UNALIGNED)
    sharder = RobeEmbeddingBagCollectionSharder(fused_params=FUSED)
    plan = common.plan_for(ebc, {"t0": "table_wise", "t1": "data_parallel",
                                 "t2": "table_wise"}, 2, sharder)
    with pytest.raises(ValueError, match=r"row-wise Adagrad .* multiple of block_size.*"
                                         r"array 2 starts at 809.*RobeConfig\(shared=True\)"):
        validate_rowwise_state(ebc.layout, plan, RowWiseAdagrad, 2)
    # the same layout all data-parallel, or with Adagrad, is fine
    validate_rowwise_state(ebc.layout, common.plan_for(ebc, DP, 2, sharder), RowWiseAdagrad, 2)
    validate_rowwise_state(ebc.layout, plan, torch.optim.Adagrad, 2)
    aligned = common.make_ebc(ALIGNED)
    validate_rowwise_state(aligned.layout, common.plan_for(aligned, TW, 2, sharder),
                           RowWiseAdagrad, 2)


def _refused(rank, world):
    try:
        common.make_dmp(UNALIGNED, TW, world, fused_params=FUSED)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.slow
def test_unaligned_table_wise_is_refused_when_sharding():
    for message in run_ranks(_refused, 2):
        assert message is not None and "use Adagrad" in message, message
