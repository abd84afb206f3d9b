"""Sharded == unsharded, step for step, for DATA_PARALLEL, TABLE_WISE and a mix of both,
with each fused optimizer (from apply_optimizer_in_backward or from fused_params)."""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from robe_torchrec import RobeConfig
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

STEPS = 20

CASES = {
    # name: (robe config, plan, optimizer (apply_optimizer_in_backward), fused_params)
    "dp_shared_sgd": (RobeConfig(compression=10, block_size=4, shared=True),
                      {"t0": "data_parallel", "t1": "data_parallel", "t2": "data_parallel"},
                      (torch.optim.SGD, {"lr": 0.5}), None),
    "tw_sgd": (RobeConfig(compression=10, block_size=4, shared=False),
               {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"},
               (torch.optim.SGD, {"lr": 0.5}), None),
    "tw_adagrad_fused_params": (RobeConfig(compression=10, block_size=4, shared=False),
                                {"t0": "table_wise", "t1": "table_wise", "t2": "table_wise"},
                                None, {"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                       "learning_rate": 0.1, "eps": 1e-8}),
    "mixed_adam": (RobeConfig(compression=10, block_size=4, shared=False),
                   {"t0": "data_parallel", "t1": "table_wise", "t2": "table_wise"},
                   (torch.optim.Adam, {"lr": 0.01}), None),
    "weighted_mixed_sgd": (RobeConfig(compression=10, block_size=4, shared=False),
                           {"t0": "data_parallel", "t1": "table_wise", "t2": "table_wise"},
                           (torch.optim.SGD, {"lr": 0.5}), None),
    "dp_adagrad": (RobeConfig(compression=10, block_size=4, shared=False),
                   {"t0": "data_parallel", "t1": "data_parallel", "t2": "data_parallel"},
                   (torch.optim.Adagrad, {"lr": 0.1}), None),
}
TW_RANKS = {"t0": 0, "t1": 1, "t2": 0}


def _reference_optimizer(case):
    _robe, _types, optimizer, fused = case
    if optimizer is not None:
        return optimizer
    assert fused["optimizer"] == EmbOptimType.EXACT_ADAGRAD
    return torch.optim.Adagrad, {"lr": fused["learning_rate"], "eps": fused["eps"]}


def _run_case(rank: int, world: int, name: str):
    case = CASES[name]
    robe, types, optimizer, fused = case
    weighted = name.startswith("weighted")
    dmp = common.make_dmp(robe, types, world, optimizer=optimizer, fused_params=fused,
                          ranks=TW_RANKS, is_weighted=weighted)
    ref = common.make_ebc(robe, is_weighted=weighted)
    opt_cls, opt_kwargs = _reference_optimizer(case)
    ref_opt = opt_cls([ref.weight], **opt_kwargs)
    # as TorchRec: every array sees the gradient averaged over ranks (DATA_PARALLEL by our
    # all-reduce, TABLE_WISE by TorchRec's gradient division in the output all-to-all)
    assert torch.equal(common.full_weight(dmp), ref.weight.detach())

    worst_out = worst_w = 0.0
    for step in range(STEPS):
        kjt = common.global_batch(step, world, weighted=weighted)
        tgt = common.target(step, world * common.B, ref.layout.output_dim)
        out = dmp(common.local_slice(kjt, rank))
        lo, hi = rank * common.B, (rank + 1) * common.B
        loss = 0.5 * ((out - tgt[lo:hi]) ** 2).sum()
        loss.backward()
        ref_out = ref(kjt).values()
        worst_out = max(worst_out, (out.detach() - ref_out[lo:hi].detach()).abs().max().item())
        ref_loss = 0.5 * ((ref_out - tgt) ** 2).sum()
        ref_loss.backward()
        ref.weight.grad.div_(world)
        ref_opt.step()
        ref_opt.zero_grad()
        worst_w = max(worst_w, (common.full_weight(dmp) - ref.weight.detach()).abs().max().item())
    moved = (ref.weight.detach() - common.make_ebc(robe).weight.detach()).abs().max().item()
    return worst_out, worst_w, moved


@pytest.fixture(scope="module")
def results():
    """Every case's results by rank, from one pair of processes (starting a pair costs more
    than most cases)."""
    return run_ranks(common.run_cases, 2, _run_case, list(CASES), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_matches_unsharded(name, results):
    for by_case in results:
        worst_out, worst_w, moved = by_case[name]
        assert moved > 1e-3  # training did change the arrays
        assert worst_out <= 1e-5, (name, worst_out)
        assert worst_w <= 1e-5, (name, worst_w)
