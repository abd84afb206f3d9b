"""The Triton kernels against the reference ops, on any device: the checks shared by the CPU
tests (Triton's interpreter), the GPU tests (``tests/ops/test_gpu.py``) and the one-call GPU
proof ``benchmarks/gpu_check.py``, which runs them without pytest.

Every check builds fresh random inputs (:mod:`robe_torchrec.testing.op_cases`), moves them to the device,
runs the Triton implementation and the pure-PyTorch reference on the same tensors and raises
``AssertionError`` on a mismatch. :func:`triton_checks` lists them by name.

Example::

    >>> for name, check in triton_checks("cuda"):
    ...     check()                      # raises AssertionError naming what differs
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, List, Optional, Tuple
from unittest import mock

import torch

import robe_torchrec.ops
from robe_torchrec.hashing import HashMode
from robe_torchrec.ops import cpu_backend, defer_checks, raise_pending_checks, reference
from robe_torchrec.ops.deferred_checks import DeferredCheckError
from robe_torchrec.ops import triton_kernels as tk
from robe_torchrec.ops.meta import Optimizer, rowwise_state_size
from robe_torchrec.ops.tuning import tuned

from robe_torchrec.testing.op_cases import OpCase, case_matrix, fused_steps, random_case

#: the fused optimizers, with the op's hparams (lr, eps, beta1, beta2, weight_decay)
OPTIMIZERS = {
    "sgd": (Optimizer.SGD, [0.05, 1e-8, 0.9, 0.999, 0.01]),
    "adagrad": (Optimizer.ADAGRAD, [0.05, 1e-8, 0.9, 0.999, 0.0]),
    "rowwise_adagrad": (Optimizer.ROWWISE_ADAGRAD, [0.05, 1e-8, 0.9, 0.999, 0.01]),
    "adam": (Optimizer.ADAM, [0.05, 1e-8, 0.9, 0.999, 0.01]),
}

#: a case at GPU scale (many programs, full column tiles, long bags, 1 Mi-float array)
LARGE = dict(seed=300, dims=[128, 64, 128, 32], batch=512, max_bag=300, block_size=32,
             hash_mode=int(HashMode.MIX), memory_size=1 << 20, weighted=True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Relative to the largest reference magnitude (sums of thousands of rows)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}")
    assert actual.device == expected.device, f"{actual.device} != {expected.device}"
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1.0))


def _tol(case: OpCase) -> float:
    return 1e-12 if case.weights.dtype == torch.float64 else 1e-5


def check_forward(case: OpCase) -> None:
    assert_close(tk.forward(*case.forward_args()), reference.forward(*case.forward_args()),
                 _tol(case))


def check_backward_dense(case: OpCase) -> None:
    g = case.grad()
    assert_close(tk.backward_dense(*case.backward_args(g)),
                 reference.backward_dense(*case.backward_args(g)), _tol(case))


def check_per_sample_weights_grad(case: OpCase) -> None:
    g = case.grad()
    actual = tk.per_sample_weights_grad(*case.psw_grad_args(g))
    assert not actual.isnan().any(), "an entry was never written"
    assert_close(actual, reference.per_sample_weights_grad(*case.psw_grad_args(g)), _tol(case))


def fused_states(case: OpCase, optimizer: Optimizer) -> List[torch.Tensor]:
    """``[state1, state2]`` of ``optimizer`` for the case's weights (empty where unused)."""
    numel, device = case.weights.numel(), case.weights.device
    empty = torch.empty(0, device=device)
    if optimizer == Optimizer.ROWWISE_ADAGRAD:
        return [torch.full((rowwise_state_size(numel, case.block_size),), 0.1, device=device),
                empty]
    if optimizer == Optimizer.ADAGRAD:
        return [torch.full((numel,), 0.1, device=device), empty]
    if optimizer == Optimizer.ADAM:
        return [torch.zeros(numel, device=device), torch.zeros(numel, device=device)]
    return [empty, empty]


#: relative rounding error of a float32 gradient element, against the sum of the magnitudes
#: of its terms (a sum of thousands of terms in any order stays well inside it)
_GRADIENT_ROUNDING = 1e-5


def adam_slack(case: OpCase, hparams: List[float], steps: int) -> torch.Tensor:
    """Per-element error that ``steps`` exact Adam steps can show when their gradients carry
    float32 rounding: the GPU scatters them with atomics, so their last bits depend on the
    order. Adam divides its first moment ``m`` by ``sqrt(v)``; where the terms that make up
    ``m`` nearly cancel (within one gradient, or across steps), the step is ill conditioned.
    An error of ``rounding * M`` in ``m`` (``M``: the same moment of the terms' magnitudes)
    moves the step by ``lr * rounding * M / sqrt(v)``; doubled for the error in ``v``, at most
    ``2 * lr`` a step (a flipped sign). Where nothing cancels this slack is far below any
    real error of the step (order ``lr``). Computed in float64 along the reference's path."""
    lr, eps, beta1, beta2, weight_decay = hparams
    f64 = dict(dtype=torch.float64)
    w = case.weights.to(**f64)
    m, v, magnitude_m, slack = (torch.zeros_like(w) for _ in range(4))
    psw = case.per_sample_weights
    for step in range(1, steps + 1):
        g = case.grad(seed=step)
        grad = reference.backward_dense(*case.backward_args(g)).to(**f64) + weight_decay * w
        magnitude = reference.backward_dense(
            g.abs(), case.weights, case.values, case.offsets, None if psw is None else psw.abs(),
            case.table_meta, case.block_size, case.hash_mode, case.hash_params
        ).to(**f64) + weight_decay * w.abs()
        m = beta1 * m + (1 - beta1) * grad
        magnitude_m = beta1 * magnitude_m + (1 - beta1) * magnitude
        v = beta2 * v + (1 - beta2) * grad * grad
        denominator = (v / (1 - beta2 ** step)).sqrt() + eps
        bias1 = 1 - beta1 ** step
        step_error = 2 * lr * _GRADIENT_ROUNDING * magnitude_m / bias1 / denominator
        slack += step_error.clamp(max=2 * lr)
        w = w - lr * m / bias1 / denominator
    return slack.to(case.weights.dtype)


def check_fused(case: OpCase, name: str, steps: int = 2) -> None:
    """``steps`` fused steps of the Triton kernels and of the reference from the same state."""
    optimizer, hparams = OPTIMIZERS[name]
    states = [fused_states(case, optimizer) for _ in range(2)]
    w_tk = fused_steps(tk, case, optimizer, hparams, states[0], steps=steps)
    w_ref = fused_steps(reference, case, optimizer, hparams, states[1], steps=steps)
    assert not torch.equal(w_tk, case.weights), "the fused step changed nothing"
    if optimizer == Optimizer.ADAM:
        scale = float(w_ref.abs().max())
        excess = (w_tk - w_ref).abs() - adam_slack(case, hparams, steps) - _tol(case) * scale
        assert float(excess.max()) <= 0, (
            f"Adam's weights differ beyond the gradient's rounding at "
            f"{int((excess > 0).sum())} elements (worst by {float(excess.max()):.3g})")
    else:
        assert_close(w_tk, w_ref, _tol(case))
    for actual, expected in zip(*states):
        assert_close(actual, expected, _tol(case))


@contextlib.contextmanager
def bag_kernels(short_bags: bool):
    """The Triton forward and backward take their short-bags kernels (or their
    one-bag-a-program kernels) whatever the bag lengths, inside the block."""
    with tuned(short_bag_mean=float("inf") if short_bags else -1.0):
        yield


def check_forward_both_kernels(case: OpCase) -> None:
    """Both Triton forward kernels against the reference; on bags of at most two ids they
    must also agree bitwise (pooling one or two ids is exact in either order)."""
    expected = reference.forward(*case.forward_args())
    outputs = []
    for short_bags in (False, True):
        with bag_kernels(short_bags):
            outputs.append(tk.forward(*case.forward_args()))
        assert_close(outputs[-1], expected, _tol(case))
    if int((case.offsets[1:] - case.offsets[:-1]).max()) <= 2:
        assert torch.equal(*outputs), "the two forward kernels differ on short bags"


def check_backward_both_kernels(case: OpCase) -> None:
    """Both Triton backward kernels (one bag a program, several) against the reference."""
    for short_bags in (False, True):
        with bag_kernels(short_bags):
            check_backward_dense(case)


def _bad_inputs(case: OpCase) -> List[Tuple[int, torch.Tensor]]:
    """``(position in forward_args, bad tensor)``: an id out of range, decreasing offsets."""
    bad_ids = case.values.clone()
    bad_ids[-1] = 10**9
    bad_offsets = case.offsets.clone()
    middle = bad_offsets.numel() // 2
    bad_offsets[middle] = bad_offsets[middle + 1] + 1
    return [(1, bad_ids), (2, bad_offsets)]


def _with(args: tuple, position: int, tensor: torch.Tensor) -> tuple:
    return args[:position] + (tensor,) + args[position + 1:]


def check_bad_input_is_refused(case: OpCase) -> None:
    """The Triton ops' one-pass input checks, read at the call, refuse an id out of range
    and decreasing offsets with the reference's message."""
    args = case.forward_args()  # weights, values, offsets, ...
    for position, bad in _bad_inputs(case):
        messages = []
        for impl in (tk, reference):
            try:
                with defer_checks(False):
                    impl.forward(*_with(args, position, bad))
                messages.append(None)
            except ValueError as exc:
                messages.append(str(exc))
        assert messages[0] is not None and messages[0] == messages[1], messages


def check_deferred_bad_input(case: OpCase) -> None:
    """Deferred checks: a forward on bad input returns; the problem is raised later with
    the reference's message, and by the fused backward of the same inputs before it
    changes the weights or the optimizer state."""
    args = case.forward_args()
    optimizer, hparams = OPTIMIZERS["adagrad"]
    for position, bad in _bad_inputs(case):
        expected = None
        try:
            reference.forward(*_with(args, position, bad))
        except ValueError as exc:
            expected = str(exc)
        assert expected is not None, "the reference took the bad input"
        with defer_checks(True):
            tk.forward(*_with(args, position, bad))  # must not raise: the answer is queued
            try:
                raise_pending_checks()
                raised = None
            except DeferredCheckError as exc:
                raised = str(exc)
            assert raised is not None and raised.startswith(expected), (raised, expected)

            weights, state = case.weights.clone(), fused_states(case, optimizer)
            before = [weights.clone()] + [s.clone() for s in state]
            bad_case = OpCase(**{**case.__dict__, "weights": weights,
                                 ("values", "offsets")[position - 1]: bad})
            tk.forward(*bad_case.forward_args())
            grad, _, *lookup = bad_case.backward_args(case.grad())
            # raised by the backward if the forward's answer was ready, else by the next
            # read; either way the backward wrote nothing
            try:
                tk.backward_fused_(grad, weights, *state, *lookup, int(optimizer), hparams, 1)
                raise_pending_checks()
                raised = None
            except DeferredCheckError as exc:
                raised = str(exc)
            assert raised is not None and raised.startswith(expected), (raised, expected)
            for kept, now in zip(before, [weights] + state):
                assert torch.equal(kept, now), "the fused backward changed state on bad input"


def check_deferred_answers_kept_apart(case: OpCase) -> None:
    """Many deferred forwards, every third on bad ids, more than the queue holds: each bad
    input is reported exactly once and no good one is (on a GPU the answers' pinned buffers
    are reused, so one answer must never read another's counts)."""
    from robe_torchrec.ops.deferred_checks import MAX_PENDING

    args = case.forward_args()
    (position, bad_ids), _ = _bad_inputs(case)
    calls = 2 * MAX_PENDING + 5
    bad_calls = set(range(0, calls, 3))
    reported = 0
    with defer_checks(True):
        for call in range(calls):
            while True:
                try:
                    tk.forward(*(_with(args, position, bad_ids) if call in bad_calls else args))
                    break
                except DeferredCheckError:  # an earlier call's bad input, read before this
                    reported += 1          # call ran: run it again
        while True:
            try:
                raise_pending_checks()
                break
            except DeferredCheckError:
                reported += 1
    assert reported == len(bad_calls), (reported, len(bad_calls))


def check_index_dtypes_agree(case: OpCase) -> None:
    """int32 and int64 ids give bitwise the same forward and per-sample-weight gradient."""
    other = OpCase(**{**case.__dict__, "values": case.values.to(torch.int32),
                      "offsets": case.offsets.to(torch.int32)})
    wide = OpCase(**{**case.__dict__, "values": case.values.to(torch.int64),
                     "offsets": case.offsets.to(torch.int64)})
    assert torch.equal(tk.forward(*other.forward_args()), tk.forward(*wide.forward_args()))
    if case.per_sample_weights is not None:
        g = case.grad()
        assert torch.equal(tk.per_sample_weights_grad(*other.psw_grad_args(g)),
                           tk.per_sample_weights_grad(*wide.psw_grad_args(g)))


def _triton_dispatch(device: torch.device):
    """The registered ops reach Triton: always for CUDA tensors, for CPU tensors when asked."""
    return contextlib.nullcontext() if device.type == "cuda" else cpu_backend("triton")


def _op_forward_backward(case: OpCase, fn: Callable) -> Tuple[torch.Tensor, ...]:
    w = case.weights.clone().requires_grad_(True)
    psw = case.per_sample_weights.clone().requires_grad_(True)
    with _triton_dispatch(case.weights.device):
        out = fn(w, psw)
        (out * case.grad()).sum().backward()
    return out.detach(), w.grad, psw.grad


def _expected_forward_backward(case: OpCase) -> Tuple[torch.Tensor, ...]:
    g = case.grad()
    return (reference.forward(*case.forward_args()),
            reference.backward_dense(*case.backward_args(g)),
            reference.per_sample_weights_grad(*case.psw_grad_args(g)))


def _registered_forward(case: OpCase, weights, per_sample_weights):
    rest = case.forward_args()
    return torch.ops.robe.forward(weights, rest[1], rest[2], per_sample_weights, *rest[4:])


def check_registered_op(case: OpCase) -> None:
    """``torch.ops.robe.forward`` with autograd (weights and per-sample weights)."""
    actual = _op_forward_backward(case, functools.partial(_registered_forward, case))
    for a, e in zip(actual, _expected_forward_backward(case)):
        assert_close(a, e, _tol(case))


def check_forward_goes_straight(case: OpCase) -> None:
    """For plain tensors, ``robe::forward``'s autograd layer calls the Triton implementation
    itself instead of dispatching a second time (host time a GPU forward waits on): checked
    on the device's own dispatch key set, with and without weights that require grad."""
    redispatch = mock.Mock(wraps=torch.ops.robe.forward.default.redispatch)
    expected = reference.forward(*case.forward_args())
    with _triton_dispatch(case.weights.device), \
            mock.patch.object(robe_torchrec.ops, "_FORWARD", mock.Mock(redispatch=redispatch)):
        with torch.no_grad():
            out = torch.ops.robe.forward(*case.forward_args())
        trained = torch.ops.robe.forward(case.weights.clone().requires_grad_(True),
                                         *case.forward_args()[1:])
    assert redispatch.call_count == 0, (
        f"robe::forward dispatched twice for plain {case.weights.device.type} tensors")
    assert_close(out, expected, _tol(case))
    assert_close(trained.detach(), expected, _tol(case))


def check_compiled(case: OpCase, backend: Optional[str] = None) -> None:
    """``torch.compile(fullgraph=True)`` of a function around the op, forward and backward
    (inductor on CUDA; ``aot_eager`` on CPU, where inductor would build C++ for minutes)."""
    torch._dynamo.reset()
    backend = backend or ("inductor" if case.weights.device.type == "cuda" else "aot_eager")

    def model(weights, per_sample_weights):
        return torch.relu(_registered_forward(case, weights, per_sample_weights)) * 2.0

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    actual = _op_forward_backward(case, compiled)
    expected = _op_forward_backward(case, model)
    for a, e in zip(actual, expected):
        assert_close(a, e, _tol(case))


def check_low_precision(case: OpCase) -> None:
    """bfloat16 storage: float32 output equal to the reference's on the same bf16 weights."""
    low = OpCase(**{**case.__dict__, "weights": case.weights.to(torch.bfloat16)})
    out = tk.forward(*low.forward_args())
    assert out.dtype == torch.float32
    assert_close(out, reference.forward(*low.forward_args()), 1e-5)


def triton_checks(device, quick: bool = False) -> List[Tuple[str, Callable[[], None]]]:
    """``(name, check)`` for every kernel check on ``device``; a check builds its own inputs
    when called. ``quick``: a few small cases (Triton's interpreter runs each program in
    Python, so the CPU mode keeps to seconds)."""
    device = torch.device(device)
    matrix = case_matrix()
    # mix hash + int64 ids + per-sample weights; reference hash + int32 ids + MEAN pooling
    weighted = [2, 1]
    forward_cases = [1, 2, len(matrix) - 1] if quick else list(range(len(matrix)))

    def case(kw, **extra):
        return lambda: random_case(**dict(kw, **extra)).to(device)

    builders = {f"case{i}": case(matrix[i]) for i in forward_cases}
    if not quick:
        builders["large"] = case(LARGE)
        builders["float64"] = case(matrix[2], dtype=torch.float64)
    checks = []
    for label, build in builders.items():
        checks += [(f"forward[{label}]", lambda b=build: check_forward(b())),
                   (f"backward_dense[{label}]", lambda b=build: check_backward_dense(b()))]
    for i in weighted if not quick else weighted[:1]:
        checks.append((f"per_sample_weights_grad[case{i}]",
                       lambda b=case(matrix[i]): check_per_sample_weights_grad(b())))
    fused_case = case(matrix[1], batch=3) if quick else case(LARGE, batch=64)
    for name in OPTIMIZERS:
        checks.append((f"fused[{name}]", lambda n=name: check_fused(fused_case(), n)))
    short_bags = case(matrix[2], batch=5, max_bag=2) if quick else case(
        dict(LARGE, max_bag=2, batch=300))
    checks += [
        ("forward_both_kernels", lambda: check_forward_both_kernels(short_bags())),
        ("backward_both_kernels", lambda: check_backward_both_kernels(short_bags())),
        ("bad_input_refused", lambda: check_bad_input_is_refused(case(matrix[1], batch=4)())),
        ("deferred_bad_input", lambda: check_deferred_bad_input(case(matrix[1], batch=4)())),
        ("deferred_answers_kept_apart",
         lambda: check_deferred_answers_kept_apart(case(matrix[1], batch=4)())),
        ("int32_int64_ids_agree", lambda: check_index_dtypes_agree(case(matrix[2], batch=4)())),
        ("registered_op_autograd", lambda: check_registered_op(case(matrix[1], batch=4)())),
        ("forward_goes_straight", lambda: check_forward_goes_straight(case(matrix[1], batch=4)())),
        ("torch_compile", lambda: check_compiled(case(matrix[1], batch=4)())),
    ]
    if not quick:
        checks.append(("bfloat16_storage", lambda: check_low_precision(case(matrix[2])())))
    return checks
