"""The production dense update (torch.optim's functional steps) against the reference oracle
and the fused C++ kernel: the data-parallel path and the fused path update alike."""

from __future__ import annotations

import pytest
import torch

from robe_torchrec.ops import cpu, reference
from robe_torchrec.ops.dense_update import apply_dense_update_
from robe_torchrec.ops.meta import Optimizer, rowwise_state_size
from robe_torchrec.testing.op_cases import random_case


def _states(code: Optimizer, weights: torch.Tensor, block_size: int):
    g = torch.Generator().manual_seed(5)
    size = (rowwise_state_size(weights.numel(), block_size)
            if code == Optimizer.ROWWISE_ADAGRAD else weights.numel())
    state1 = torch.rand(size, generator=g) if code != Optimizer.SGD else weights.new_empty(0)
    state2 = torch.rand(size, generator=g) if code == Optimizer.ADAM else weights.new_empty(0)
    return state1, state2


@pytest.mark.parametrize("code", list(Optimizer))
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("block_size", [4, 3])  # 997 floats: rows of 4 leave a short one
def test_dense_update_matches_the_oracle_and_the_fused_kernel(code, weight_decay, block_size):
    case = random_case(7, weighted=True, block_size=block_size)
    hparams = [0.05, 1e-8, 0.9, 0.999, weight_decay]
    ours = [case.weights.clone(), *_states(code, case.weights, block_size)]
    oracle = [t.clone() for t in ours]
    fused = [t.clone() for t in ours]
    for step in range(1, 5):
        grad_output = torch.randn(case.batch, case.output_dim,
                                  generator=torch.Generator().manual_seed(step))
        grad = reference.backward_dense(*case.backward_args(grad_output))
        weights, state1, state2 = ours
        apply_dense_update_(weights, grad, state1, state2, int(code), hparams, step, block_size)
        weights, state1, state2 = oracle
        reference.apply_optimizer_(weights, grad, state1, state2, int(code), hparams, step,
                                   block_size)
        cpu.backward_fused_(grad_output, *fused, case.values, case.offsets,
                            case.per_sample_weights, case.table_meta, case.block_size,
                            case.hash_mode, case.hash_params, int(code), hparams, step)
        for mine, theirs, kernel in zip(ours, oracle, fused):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(mine, kernel, rtol=1e-5, atol=1e-6)


def test_unknown_optimizer_is_refused():
    w = torch.zeros(4)
    with pytest.raises(ValueError, match="unknown fused optimizer"):
        apply_dense_update_(w, w.clone(), w.new_empty(0), w.new_empty(0), 7, [0.1] * 5, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_dense_update_steps_in_float32(dtype):
    case = random_case(8, weighted=True, block_size=5)
    low = case.weights.to(dtype)
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.01]
    grad = reference.backward_dense(*case.backward_args(torch.randn(case.batch, case.output_dim)))
    rows = rowwise_state_size(low.numel(), 5)
    w_low, s_low = low.clone(), torch.zeros(rows)
    w_32, s_32 = low.float(), torch.zeros(rows)
    apply_dense_update_(w_low, grad.to(dtype), s_low, s_low.new_empty(0),
                        int(Optimizer.ROWWISE_ADAGRAD), hparams, 1, 5)
    apply_dense_update_(w_32, grad.to(dtype).float(), s_32, s_32.new_empty(0),
                        int(Optimizer.ROWWISE_ADAGRAD), hparams, 1, 5)
    assert w_low.dtype == dtype and torch.equal(w_low, w_32.to(dtype))
    assert torch.equal(s_low, s_32)
