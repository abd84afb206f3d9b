"""The torch.library registration: schemas, fake (meta) kernels and autograd pass
torch.library.opcheck, and torch.compile traces through the ops without graph breaks."""

import pytest
import torch

import robe_torchrec.ops  # noqa: F401  (registers torch.ops.robe.*)
from robe_torchrec.ops.meta import Optimizer
from tests.ops.cases import random_case


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


def test_opcheck_fused_backward():
    case = random_case(4)
    grad = torch.randn(case.batch, case.output_dim)
    state1, state2 = torch.zeros_like(case.weights), torch.zeros_like(case.weights)
    args = (grad, case.weights, state1, state2, case.values, case.offsets, None, case.table_meta,
            case.block_size, case.hash_mode, case.hash_params, int(Optimizer.ADAM),
            [1e-2, 1e-8, 0.9, 0.999, 0.0], 1)
    torch.library.opcheck(torch.ops.robe.backward_fused_.default, args,
                          test_utils=("test_schema", "test_faketensor"))


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


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(1.5).expand(7, 5),           # out.sum()'s gradient: strides (0, 0)
    lambda: torch.randn(1, 5).expand(7, 5),           # a broadcast row
    lambda: torch.randn(7, 1).expand(7, 5),           # a broadcast column
    lambda: torch.randn(5, 7).t(),                    # transposed
    lambda: torch.randn(0, 5).expand(0, 5),
])
def test_kernel_gradient_is_contiguous_with_the_same_values(make):
    from robe_torchrec.ops.args import kernel_gradient

    grad = make()
    out = kernel_gradient(grad)
    assert out.is_contiguous() and torch.equal(out, grad)


def test_sum_loss_gradient_equals_a_materialised_one():
    """``out.sum().backward()`` hands the backward a (0, 0)-strided gradient; the dense
    gradient must equal the one computed from the same values passed contiguous."""
    case = random_case(3)
    weights = case.weights.clone().requires_grad_()
    torch.ops.robe.forward(weights, *case.forward_args()[1:]).sum().backward()
    ones = torch.ones(case.batch, case.output_dim, dtype=case.weights.dtype)
    assert torch.equal(weights.grad, torch.ops.robe.backward_dense(*case.backward_args(ones)))
