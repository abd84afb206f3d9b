"""The fused ops' learning-rate tensor (``lr=``): every implementation reads the rate from it
in place of ``hparams[0]``, and steps exactly as with that rate as a float. The modules pass
it so that a scheduler's new rate neither recompiles a compiled backward nor goes unseen by
a CUDA graph's replays (``tests/test_drop_in.py``; the replays in
``robe_torchrec/testing/gpu_checks.py``)."""

import math

import pytest
import torch

from robe_torchrec.ops import cpu as cpu_ops
from robe_torchrec.ops import reference
from robe_torchrec.ops import triton_kernels as tk
from robe_torchrec.ops.meta import Optimizer
from robe_torchrec.testing.op_cases import random_case
from robe_torchrec.testing.op_checks import OPTIMIZERS, fused_states

IMPLEMENTATIONS = {"cpu": cpu_ops, "reference": reference, "triton": tk}


def _steps(impl, case, optimizer, hparams, lr=None, steps=2):
    """Two fused steps of ``impl`` from the case's weights; returns weights and states."""
    weights, states = case.weights.clone(), fused_states(case, optimizer)
    for step in range(1, steps + 1):
        grad = torch.randn(case.batch, case.output_dim,
                           generator=torch.Generator().manual_seed(step))
        impl.backward_fused_(grad, weights, *states, case.values, case.offsets,
                             case.per_sample_weights, case.table_meta, case.block_size,
                             case.hash_mode, case.hash_params, int(optimizer), hparams, step,
                             lr)
    return [weights, *states]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
def test_rate_tensor_steps_as_the_float(impl, name):
    """``hparams[0]`` is NaN, so a step that read it instead of the tensor spoils every
    weight it touches."""
    case = random_case(11, weighted=True)
    optimizer, hparams = OPTIMIZERS[name]
    as_float = _steps(IMPLEMENTATIONS[impl], case, optimizer, hparams)
    rate = torch.tensor(hparams[0], dtype=torch.float64)
    as_tensor = _steps(IMPLEMENTATIONS[impl], case, optimizer, [math.nan] + hparams[1:], rate)
    for got, expected in zip(as_tensor, as_float):
        assert torch.equal(got, expected)


def test_rate_tensor_of_another_dtype_is_read_as_its_value():
    """A float32 rate steps as the float it holds (the kernels widen it to float64)."""
    case = random_case(12)
    optimizer, hparams = OPTIMIZERS["adam"]
    rate = torch.tensor(0.03, dtype=torch.float32)
    expected = _steps(tk, case, optimizer, [float(rate)] + hparams[1:])
    got = _steps(tk, case, optimizer, [math.nan] + hparams[1:], rate)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("name", ["adam", "rowwise_adagrad"])
def test_rate_tensor_with_a_device_step(name):
    """The Triton path with the step counted on the device (a capturable optimizer's): rate
    and step both read by the kernel."""
    case = random_case(13)
    optimizer, hparams = OPTIMIZERS[name]
    host = _steps(tk, case, optimizer, hparams, steps=1)
    weights, states = case.weights.clone(), fused_states(case, optimizer)
    grad = torch.randn(case.batch, case.output_dim, generator=torch.Generator().manual_seed(1))
    tk.counted_backward_fused_(grad, weights, *states, torch.zeros(()), int(optimizer),
                               [math.nan] + hparams[1:], case.values, case.offsets,
                               case.per_sample_weights, case.table_meta, case.block_size,
                               case.hash_mode, case.hash_params,
                               torch.tensor(hparams[0], dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip([weights, *states], host))


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("bad,problem", [
    (torch.tensor([0.1, 0.2]), "shape"), (torch.tensor(1), "int64"),
    (torch.tensor(0.1, device="meta"), "meta")])
def test_a_bad_rate_tensor_is_refused(impl, bad, problem):
    case = random_case(14)
    optimizer, hparams = OPTIMIZERS["sgd"]
    before = case.weights.clone()
    with pytest.raises(ValueError, match=rf"lr must be one float on the weights' device.*{problem}"):
        _steps(IMPLEMENTATIONS[impl], case, optimizer, hparams, bad, steps=1)
    assert torch.equal(case.weights, before)


def test_the_op_takes_the_rate_through_the_dispatcher():
    """``torch.ops.robe.counted_backward_fused_(..., lr)``: the modules' call."""
    case = random_case(15)
    optimizer, hparams = OPTIMIZERS["adagrad"]
    expected = _steps(cpu_ops, case, optimizer, hparams, steps=1)
    weights, states = case.weights.clone(), fused_states(case, optimizer)
    grad = torch.randn(case.batch, case.output_dim, generator=torch.Generator().manual_seed(1))
    torch.ops.robe.counted_backward_fused_(
        grad, weights, *states, None, int(Optimizer.ADAGRAD), [math.nan] + hparams[1:],
        case.values, case.offsets, case.per_sample_weights, case.table_meta, case.block_size,
        case.hash_mode, case.hash_params, torch.tensor(hparams[0], dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip([weights, *states], expected))
