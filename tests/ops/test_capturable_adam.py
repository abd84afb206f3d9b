"""Adam (and row-wise Adagrad) with ``capturable=True``: the step count kept on the array's
device, advanced there and read by the Triton optimizer kernel, never by the host (what a
CUDA graph needs to replay fused Adam). On CPU tensors the Triton path runs in Triton's
interpreter. The module-level path (C++ kernel) is tested in ``tests/test_optim.py``.
The capture itself is checked on a GPU (``check_graph_capturable_adam`` in
``robe_torchrec/testing/gpu_checks.py``)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this module

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from robe_torchrec.ops import triton_kernels as tk  # noqa: E402
from robe_torchrec.ops.dense_update import apply_dense_update_  # noqa: E402
from robe_torchrec.ops.meta import Optimizer  # noqa: E402
from robe_torchrec.ops.triton.common import _div_rn  # noqa: E402
from robe_torchrec.ops.triton.optimizers import _adam_bias_corrections, _pow  # noqa: E402
from robe_torchrec.optim import RobeFusedOptimizer  # noqa: E402
from robe_torchrec.testing.op_cases import random_case  # noqa: E402
from robe_torchrec.testing.op_checks import fused_states  # noqa: E402

if not tk.interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (by an earlier test "
                "module?); run this file in its own process", allow_module_level=True)

STEPS = 3


# ---------------------------------------------------------------------------------------
# the Triton path: a device step against the host's int step
# ---------------------------------------------------------------------------------------

def _lookup(case):
    return (case.values, case.offsets, case.per_sample_weights, case.table_meta,
            case.block_size, case.hash_mode, case.hash_params)


def _host_and_device_steps(case, optimizer: Optimizer, hparams):
    """``STEPS`` fused steps from the same start, the count passed as ints (host) and as a
    step tensor on the weights' device: ``(weights, states)`` of each, and the tensor."""
    host_w, device_w = case.weights.clone(), case.weights.clone()
    host_s, device_s = fused_states(case, optimizer), fused_states(case, optimizer)
    host_s = [s.to(device_w.dtype) if s.numel() else s for s in host_s]
    device_s = [s.to(device_w.dtype) if s.numel() else s for s in device_s]
    step = torch.tensor(0.0)
    for count in range(1, STEPS + 1):
        g = case.grad(count)
        tk.backward_fused_(g, host_w, *host_s, *_lookup(case), int(optimizer), hparams, count)
        tk.counted_backward_fused_(g, device_w, *device_s, step, int(optimizer), hparams,
                                   *_lookup(case))
    return (host_w, host_s), (device_w, device_s), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_device_step_adam_equals_host_step(dtype, weight_decay):
    """Bitwise: the kernel's float64 bias corrections round to the host's (see
    test_kernel_bias_correction_matches_host for how closely they agree in general)."""
    case = random_case(3, dtype=dtype, weighted=True)
    hparams = [0.05, 1e-8, 0.9, 0.999, weight_decay]
    (host_w, host_s), (device_w, device_s), step = _host_and_device_steps(
        case, Optimizer.ADAM, hparams)
    assert not torch.equal(host_w, case.weights), "the fused step changed nothing"
    assert torch.equal(device_w, host_w)
    for device_state, host_state in zip(device_s, host_s):
        assert torch.equal(device_state, host_state)
    assert step.dtype == torch.float32 and float(step) == STEPS


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_device_step_other_optimizers_count_and_equal_host(name):
    """Their update reads no step: the device path only counts it."""
    optimizer = Optimizer[name.upper()]
    case = random_case(4)
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.01]
    (host_w, host_s), (device_w, device_s), step = _host_and_device_steps(case, optimizer,
                                                                           hparams)
    assert torch.equal(device_w, host_w)
    for device_state, host_state in zip(device_s, host_s):
        assert torch.equal(device_state, host_state)
    assert float(step) == STEPS


def test_device_step_none_counts_one():
    """No step tensor (an optimizer without one): the count is 1, as the registered op's."""
    case = random_case(5)
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.0]
    host_w, device_w = case.weights.clone(), case.weights.clone()
    host_s, device_s = fused_states(case, Optimizer.ADAM), fused_states(case, Optimizer.ADAM)
    tk.backward_fused_(case.grad(), host_w, *host_s, *_lookup(case), int(Optimizer.ADAM),
                       hparams, 1)
    tk.counted_backward_fused_(case.grad(), device_w, *device_s, None, int(Optimizer.ADAM),
                               hparams, *_lookup(case))
    assert torch.equal(device_w, host_w)


def test_device_step_is_checked():
    case = random_case(6)
    state = fused_states(case, Optimizer.ADAM)
    args = (int(Optimizer.ADAM), [0.05, 1e-8, 0.9, 0.999, 0.0], *_lookup(case))
    with pytest.raises(ValueError, match="step is on meta"):
        tk.counted_backward_fused_(case.grad(), case.weights, *state,
                                   torch.tensor(0.0, device="meta"), *args)
    with pytest.raises(ValueError, match="one number"):
        tk.counted_backward_fused_(case.grad(), case.weights, *state, torch.zeros(2), *args)


# ---------------------------------------------------------------------------------------
# the kernel's bias correction against the host's formula
# ---------------------------------------------------------------------------------------

@triton.jit
def _bias_corrections_kernel(step_ptr, out_ptr, lr: tl.float64, beta1: tl.float64,
                             beta2: tl.float64, N: tl.constexpr):
    """``[step_size, bias2_sqrt, beta1**step, beta2**step]`` rows for N steps, as the
    optimizer kernel computes them."""
    i = tl.arange(0, N)
    bias1, bias2_sqrt = _adam_bias_corrections(step_ptr + i, beta1, beta2)
    step_size = _div_rn(-tl.full([], lr, tl.float64), bias1)
    step = tl.load(step_ptr + i).to(tl.float64)
    tl.store(out_ptr + i, step_size)
    tl.store(out_ptr + N + i, bias2_sqrt)
    tl.store(out_ptr + 2 * N + i, _pow(tl.full([], beta1, tl.float64), step))
    tl.store(out_ptr + 3 * N + i, _pow(tl.full([], beta2, tl.float64), step))


def _host_bias_corrections(steps, lr, beta1, beta2) -> torch.Tensor:
    """What ``backward_fused_`` computes on the host for each int step."""
    rows = [[-lr / (1.0 - beta1 ** s) for s in steps],
            [math.sqrt(1.0 - beta2 ** s) for s in steps],
            [beta1 ** s for s in steps], [beta2 ** s for s in steps]]
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("lr,beta1,beta2", [(0.05, 0.9, 0.999), (0.01, 0.8, 0.99),
                                            (1e-3, 0.95, 0.9999)])
def test_kernel_bias_correction_matches_host(lr, beta1, beta2):
    """Steps 1 to 16384: ``beta ** step`` within an ulp of 1 of Python's (absolute: what
    ``1 - beta**step`` sees) and within 2e-15 relative while it is at least 1e-3 (where
    the bias correction still differs from 1 by more than float32 resolves); the float64
    corrections within 1e-12 relative (cancellation in ``1 - beta**step`` at small steps
    magnifies an ulp); rounded to float32, as the kernel uses them for float32 weights,
    equal to the host's at every step."""
    n = 16384
    steps = torch.arange(1, n + 1, dtype=torch.float32)
    out = torch.empty(4 * n, dtype=torch.float64)
    _bias_corrections_kernel[(1,)](steps, out, lr, beta1, beta2, N=n)
    device = out.view(4, n)
    host = _host_bias_corrections(range(1, n + 1), lr, beta1, beta2)
    powers, host_powers = device[2:], host[2:]
    assert float((powers - host_powers).abs().max()) <= 2.0 ** -52
    significant = host_powers >= 1e-3
    relative = (powers - host_powers).abs() / host_powers.abs().clamp(min=1e-300)
    assert float(relative[significant].max()) <= 2e-15
    corrections_relative = ((device[:2] - host[:2]) / host[:2]).abs()
    assert float(corrections_relative.max()) <= 1e-12
    assert torch.equal(device[:2].float(), host[:2].float())


# ---------------------------------------------------------------------------------------
# RobeFusedOptimizer: where the step lives
# ---------------------------------------------------------------------------------------

def _adam(param: torch.Tensor, capturable: bool) -> RobeFusedOptimizer:
    return RobeFusedOptimizer("weight", param, torch.optim.Adam,
                              {"lr": 0.01, "capturable": capturable})


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_capturable_step_lives_on_the_array_device(device):
    param = torch.zeros(64, device=device)
    step = _adam(param, capturable=True).param_state["step"]
    assert step.device == param.device and step.dtype == torch.float32 and step.dim() == 0
    step = _adam(param, capturable=False).param_state["step"]
    assert step.device == torch.device("cpu") and step.dtype == torch.float32


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.Adagrad, {"lr": 0.1}),
    ("rowwise", {"lr": 0.1}),
    ("rowwise", {"lr": 0.1, "capturable": True}),
])
def test_a_step_no_update_reads_lives_on_the_array_device(cls, kwargs):
    """Adagrad's and row-wise Adagrad's count (lr_decay is 0) lives with the array, so that
    a CUDA graph replay advances it and a compiled backward has no CPU input; SGD has none."""
    import torchrec.optim

    param = torch.zeros(64, device="meta")
    cls = torchrec.optim.RowWiseAdagrad if cls == "rowwise" else cls
    step = RobeFusedOptimizer("weight", param, cls, kwargs, block_size=4).param_state["step"]
    assert step.device == param.device and step.dtype == torch.float32 and step.dim() == 0
    carried = RobeFusedOptimizer("weight", param, cls, kwargs, block_size=4)
    carried.param_state["step"] = torch.tensor(5.0)  # from a checkpoint, say
    carried.state_tensors()
    assert carried.param_state["step"].device == param.device
    sgd = RobeFusedOptimizer("weight", param, torch.optim.SGD, {"lr": 0.1})
    assert "step" not in sgd.param_state


def test_a_step_from_elsewhere_moves_to_the_array_device_at_the_next_step():
    """A CPU step (a checkpoint of a non-capturable optimizer, a carried state) moves to a
    capturable optimizer's device when the fused backward next asks for the state (the
    meta device stands in for a GPU here)."""
    opt = _adam(torch.zeros(64, device="meta"), capturable=True)
    opt.param_state["step"] = torch.tensor(5.0)
    opt.state_tensors()
    assert opt.param_state["step"].device == torch.device("meta")
    host_opt = _adam(torch.zeros(64, device="meta"), capturable=False)
    host_opt.state_tensors()
    assert host_opt.param_state["step"].device == torch.device("cpu")


def test_rowwise_adagrad_takes_capturable_adagrad_does_not():
    import torchrec.optim

    param = torch.zeros(64, device="meta")
    opt = RobeFusedOptimizer("weight", param, torchrec.optim.RowWiseAdagrad,
                             {"lr": 0.1, "capturable": True}, block_size=4)
    assert opt.param_state["step"].device == param.device
    with pytest.raises(TypeError, match="capturable"):  # torch.optim.Adagrad's own refusal
        RobeFusedOptimizer("weight", param, torch.optim.Adagrad, {"lr": 0.1, "capturable": True})


def test_advance_step_returns_an_int_for_a_cpu_step():
    opt = _adam(torch.zeros(8), capturable=True)
    assert opt.advance_step() == 1 and opt.advance_step() == 2


def test_dense_update_takes_a_cpu_step_tensor_as_its_int():
    """The data-parallel update: a step tensor on the CPU is read (no device to wait for)
    and gives the int step's numbers."""
    g = torch.Generator().manual_seed(0)
    weights, grad = torch.randn(40, generator=g), torch.randn(40, generator=g)
    states = [[torch.zeros(40), torch.zeros(40)] for _ in range(2)]
    by_int, by_tensor = weights.clone(), weights.clone()
    hparams = [0.05, 1e-8, 0.9, 0.999, 0.01]
    for count in (1, 2):
        apply_dense_update_(by_int, grad, *states[0], int(Optimizer.ADAM), hparams, count)
        apply_dense_update_(by_tensor, grad, *states[1], int(Optimizer.ADAM), hparams,
                            torch.tensor(float(count)))
    assert torch.equal(by_int, by_tensor)
