"""The torch.library registration: schemas, fake (meta) kernels and autograd pass
torch.library.opcheck, and torch.compile traces through the ops without graph breaks."""

from unittest import mock

import pytest
import torch

import robe_torchrec.ops  # registers torch.ops.robe.*
from robe_torchrec.ops import reference
from robe_torchrec.ops.meta import Optimizer
from robe_torchrec.testing.op_cases import random_case


@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck_forward_and_backward(weighted):
    case = random_case(3, weighted=weighted, dtype=torch.float64)
    case.weights.requires_grad_(True)
    if weighted:
        case.per_sample_weights.requires_grad_(True)
    torch.library.opcheck(torch.ops.robe.forward.default, case.forward_args())
    grad = torch.randn(case.batch, case.output_dim, dtype=torch.float64)
    # the backward ops are not differentiable themselves (no double backward)
    case.weights = case.weights.detach()
    if weighted:
        case.per_sample_weights = case.per_sample_weights.detach()
    torch.library.opcheck(torch.ops.robe.backward_dense.default, case.backward_args(grad))
    torch.library.opcheck(torch.ops.robe.per_sample_weights_grad.default, case.psw_grad_args(grad))


@pytest.mark.parametrize("trainable", ["weights", "per_sample_weights"])
def test_gradient_when_one_input_requires_grad(trainable):
    """The op records its autograd node when either differentiable input requires grad on its
    own (a frozen array with trainable per-sample weights, or the reverse), and the gradient
    is the pure-PyTorch reference's."""
    case = random_case(6, weighted=True, dtype=torch.float64)
    grad = case.grad()
    gradients = []
    for forward in (torch.ops.robe.forward, reference.forward):
        case.weights = case.weights.detach().clone()
        case.per_sample_weights = case.per_sample_weights.detach().clone()
        getattr(case, trainable).requires_grad_(True)
        forward(*case.forward_args()).backward(grad)
        frozen = "weights" if trainable == "per_sample_weights" else "per_sample_weights"
        assert getattr(case, frozen).grad is None
        gradients.append(getattr(case, trainable).grad)
    torch.testing.assert_close(gradients[0], gradients[1])


def test_forward_goes_straight_to_the_implementation_only_for_plain_tensors():
    """Below its autograd layer robe::forward calls the CPU implementation directly for plain
    tensors (no second dispatch), and dispatches again for meta tensors, which only the fake
    kernel can take, and under a dispatch mode, which must see the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    case = random_case(7)
    redispatch = mock.Mock(wraps=torch.ops.robe.forward.default.redispatch)
    forward = mock.Mock(redispatch=redispatch)
    with mock.patch.object(robe_torchrec.ops, "_FORWARD", forward):
        expected = torch.ops.robe.forward(*case.forward_args())
        assert redispatch.call_count == 0
        meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a
                     for a in case.forward_args()]
        assert torch.ops.robe.forward(*meta_args).shape == expected.shape
        assert redispatch.call_count == 1
        with Seen() as mode:
            torch.testing.assert_close(torch.ops.robe.forward(*case.forward_args()), expected)
        assert redispatch.call_count == 2 and torch.ops.robe.forward.default in mode.ops


def test_opcheck_fused_backward():
    case = random_case(4)
    grad = torch.randn(case.batch, case.output_dim)
    state1, state2 = torch.zeros_like(case.weights), torch.zeros_like(case.weights)
    args = (grad, case.weights, state1, state2, case.values, case.offsets, None, case.table_meta,
            case.block_size, case.hash_mode, case.hash_params, int(Optimizer.ADAM),
            [1e-2, 1e-8, 0.9, 0.999, 0.0], 1)
    torch.library.opcheck(torch.ops.robe.backward_fused_.default, args)  # every test


def _fused_args(case, optimizer=Optimizer.ADAGRAD):
    grad = case.grad()
    state1, state2 = torch.zeros_like(case.weights), torch.zeros_like(case.weights)
    return (grad, case.weights, state1, state2, case.values, case.offsets, None,
            case.table_meta, case.block_size, case.hash_mode, case.hash_params,
            int(optimizer), [1e-2, 1e-8, 0.9, 0.999, 0.0], 1)


def test_opcheck_counted_fused_backward():
    case = random_case(4)
    grad, weights, state1, state2, *lookup, optimizer, hparams, _ = _fused_args(
        case, Optimizer.ADAM)
    args = (grad, weights, state1, state2, torch.tensor(0.0), optimizer, hparams, *lookup)
    torch.library.opcheck(torch.ops.robe.counted_backward_fused_.default, args)


def test_fused_ops_bump_the_versions_of_what_they_write():
    """Autograd and the input checks' caches see the in-place update: the version of every
    tensor the op writes goes up, the others' do not move."""
    case = random_case(8)
    args = _fused_args(case)
    versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
    torch.ops.robe.backward_fused_(*args)
    written = {1, 2, 3}
    for i, (arg, before) in enumerate(zip(args, versions)):
        if isinstance(arg, torch.Tensor):
            assert (arg._version > before) == (i in written), i
    step = torch.tensor(0.0)
    grad, weights, state1, state2, *lookup, optimizer, hparams, _ = args
    before = [t._version for t in (weights, state1, state2, step, grad)]
    torch.ops.robe.counted_backward_fused_(grad, weights, state1, state2, step, optimizer,
                                           hparams, *lookup)
    after = [t._version for t in (weights, state1, state2, step, grad)]
    assert [a > b for a, b in zip(after, before)] == [True, True, True, True, False]
    assert float(step) == 1


def test_fused_op_goes_straight_to_the_kernel_only_for_plain_tensors():
    """Past its version bump robe::backward_fused_ calls the CPU kernel directly for plain
    tensors, and dispatches again for meta tensors (the fake kernel) and under a dispatch
    mode, which must see the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    op = torch.ops.robe.backward_fused_.default
    redispatched = []
    original = torch._ops.OpOverload.redispatch

    def spy(self, *args, **kwargs):
        redispatched.append(self)
        return original(self, *args, **kwargs)

    case = random_case(9)
    args = _fused_args(case)
    with mock.patch.object(torch._ops.OpOverload, "redispatch", spy):
        torch.ops.robe.backward_fused_(*args)
        assert op not in redispatched
        torch.ops.robe.backward_fused_(*[a.to("meta") if isinstance(a, torch.Tensor) else a
                                         for a in args])
        assert redispatched.count(op) == 1
        with Seen() as mode:
            torch.ops.robe.backward_fused_(*args)
        assert redispatched.count(op) == 2 and op in mode.ops


def test_torch_compile_traces_forward_and_backward():
    case = random_case(5)
    weights = case.weights.clone().requires_grad_(True)
    args = case.forward_args()[1:]

    def loss_fn(w):
        return torch.ops.robe.forward(w, *args).square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    loss = compiled(weights)
    loss.backward()
    eager_weights = case.weights.clone().requires_grad_(True)
    eager = loss_fn(eager_weights)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(weights.grad, eager_weights.grad)
