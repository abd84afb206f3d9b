"""Row-wise Adagrad through the unsharded module: ``apply_optimizer_in_backward`` with
torchrec's ``torchrec.optim.RowWiseAdagrad`` (or the subclass ``robe_torchrec.optim
.RowWiseAdagrad``) on the module's parameters; one accumulator per aligned chunk of
``block_size`` floats of the array."""

from __future__ import annotations

import copy

import pytest
import torch
import torchrec.optim
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig
from robe_torchrec.ops import cpu_backend
from robe_torchrec.ops.meta import rowwise_state_size
from robe_torchrec.optim import RowWiseAdagrad
from tests.distributed import common

KWARGS = {"lr": 0.1, "eps": 1e-8}


def _loss(ebc, step: int) -> torch.Tensor:
    out = ebc(common.global_batch(step, 2)).values()
    return 0.5 * ((out - common.target(step, 2 * common.B, ebc.layout.output_dim)) ** 2).sum()


@pytest.mark.parametrize("robe", [RobeConfig(compression=10, block_size=4, shared=True),
                                  RobeConfig(memory_size=1002, block_size=4, shared=False)])
def test_fused_step_matches_reference_op_and_formula(robe):
    ebc = common.make_ebc(robe)
    dense = copy.deepcopy(ebc)  # the dense gradient, for the formula
    reference = copy.deepcopy(ebc)  # the same fused step by the reference ops
    theirs = copy.deepcopy(ebc)  # torchrec's own class, as a TorchRec user passes it
    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.weight], KWARGS)
    apply_optimizer_in_backward(RowWiseAdagrad, [reference.weight], KWARGS)
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, theirs.parameters(), KWARGS)
    for step in range(2):
        _loss(ebc, step).backward()
        _loss(theirs, step).backward()
        with cpu_backend("reference"):
            _loss(reference, step).backward()
    state, ref_state = ebc.fused_optimizer.param_state, reference.fused_optimizer.param_state
    z = robe.block_size
    assert theirs.weight.grad is None
    assert torch.equal(theirs.weight, ebc.weight)
    assert torch.equal(theirs.fused_optimizer.param_state["sum"], state["sum"])
    assert state["sum"].shape == (rowwise_state_size(ebc.memory_size, z),)
    assert float(state["step"]) == float(ref_state["step"]) == 2.0
    torch.testing.assert_close(state["sum"], ref_state["sum"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ebc.weight, reference.weight, rtol=1e-5, atol=1e-7)

    # torchrec's row-wise formula on the dense gradient, rows = chunks of z floats
    acc = torch.zeros(rowwise_state_size(dense.memory_size, z))
    for step in range(2):
        dense.weight.grad = None
        _loss(dense, step).backward()
        grad = dense.weight.grad
        rows = torch.arange(grad.numel()) // z
        acc += torch.zeros_like(acc).index_add_(0, rows, grad ** 2) / torch.bincount(rows)
        with torch.no_grad():
            dense.weight -= KWARGS["lr"] * grad / (acc.sqrt()[rows] + KWARGS["eps"])
    torch.testing.assert_close(state["sum"], acc, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ebc.weight, dense.weight, rtol=1e-5, atol=1e-6)


def test_module_trains_with_rowwise_adagrad():
    ebc = common.make_ebc(RobeConfig(compression=10, block_size=4))
    apply_optimizer_in_backward(RowWiseAdagrad, [ebc.weight], {"lr": 0.05})
    losses = []
    for _ in range(10):
        loss = _loss(ebc, 0)
        loss.backward()
        losses.append(loss.item())
    assert ebc.weight.grad is None
    assert losses[-1] < 0.9 * losses[0], losses
