"""A ROBE lookup whose backward applies the optimizer in place (the fused path).

Shared by the unsharded module and the sharded lookups, so the in-backward update is written
once: per-sample-weight gradient first (it must see the weights before the update), then
either ``robe::backward_fused_`` (scatter and update in one go, through
``robe::counted_backward_fused_``, defined here, which also counts the step) or, for a
data-parallel array, the dense gradient averaged over the process group and then the update
(:func:`robe_torchrec.ops.dense_update.apply_dense_update_`).

The unsharded path compiles (``torch.compile(fullgraph=True)``): the backward reads no
tensor on the host, the step counter stays a tensor until the op reads it.

Example::

    >>> args = LookupArgs(values, offsets, None, module.layout.op_args(module.table_meta))
    >>> pooled = fused_lookup(module.weight, module.fused_optimizer, args)
    >>> pooled.sum().backward()    # module.weight was updated, it has no .grad
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.ops.dense_update import apply_dense_update_
from robe_torchrec.optim import RobeFusedOptimizer


_ANCHOR = torch.empty(0, requires_grad=True)  # see fused_lookup


def fused_lookup(
    weights: torch.Tensor,
    optimizer: RobeFusedOptimizer,
    args: LookupArgs,
    all_reduce_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Pooled lookup of ``args`` in ``weights``; backward updates ``weights`` with ``optimizer``.

    With ``all_reduce_group``, the array's gradient is averaged over that group before the
    update (data-parallel arrays: every rank holds the array and sees its own batch).
    """
    per_sample_weights = args.per_sample_weights
    psw_needs_grad = per_sample_weights is not None and per_sample_weights.requires_grad
    # autograd calls backward only if an input requires grad: the per-sample weights when
    # they need a gradient, otherwise an empty leaf that never gets one (made once: a
    # compiled graph cannot create a leaf that requires grad)
    anchor = per_sample_weights if psw_needs_grad else _ANCHOR
    return _FusedLookup.apply(anchor, weights.detach(), optimizer, args, psw_needs_grad,
                              all_reduce_group)


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, weights, optimizer, args, psw_needs_grad, group):  # type: ignore[override]
        ctx.weights, ctx.optimizer, ctx.args = weights, optimizer, args
        ctx.psw_needs_grad, ctx.group = psw_needs_grad, group
        return args.forward(weights)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        args: LookupArgs = ctx.args
        weights, optimizer = ctx.weights, ctx.optimizer
        grad_output = grad_output.contiguous()
        grad_psw = None
        if ctx.psw_needs_grad and ctx.needs_input_grad[0]:
            grad_psw = args.per_sample_weights_grad(grad_output, weights)
        state1, state2 = optimizer.state_tensors()
        group = ctx.group
        if group is not None and dist.get_world_size(group) > 1:
            grad = args.backward_dense(grad_output, weights)
            dist.all_reduce(grad, group=group)
            grad.div_(dist.get_world_size(group))
            apply_dense_update_(weights, grad, state1, state2, int(optimizer.kind),
                                optimizer.hparams(), optimizer.advance_step(),
                                block_size=args.layout.block_size)
        else:
            torch.ops.robe.counted_backward_fused_(
                grad_output, weights, state1, state2, optimizer.param_state.get("step"),
                int(optimizer.kind), optimizer.hparams(), *args.flat())
        return grad_psw, None, None, None, None, None


@torch.library.custom_op("robe::counted_backward_fused_",
                         mutates_args=("weights", "state1", "state2", "step"))
def counted_backward_fused_(
    grad_output: Tensor,
    weights: Tensor,
    state1: Tensor,
    state2: Tensor,
    step: Optional[Tensor],
    optimizer: int,
    hparams: List[float],
    values: Tensor,
    offsets: Tensor,
    per_sample_weights: Optional[Tensor],
    table_meta: Tensor,
    output_dim: int,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    bounds_check: int,
) -> None:
    """``robe::backward_fused_`` that first counts the update in ``step``, the optimizer's
    scalar step tensor (``None``: an optimizer without one, the count is 1).

    The count stays a tensor up to here, so a compiled backward carries it as data; reading
    it as the int the kernels take happens inside this op. The arguments after ``hparams``
    are ``robe::forward``'s (``LookupArgs.flat()``).

    Example::

        >>> torch.ops.robe.counted_backward_fused_(grad_output, weights, state1, state2,
        ...                                        optimizer.param_state.get("step"),
        ...                                        int(optimizer.kind), optimizer.hparams(),
        ...                                        *args.flat())
    """
    count = 1
    if step is not None:
        step += 1
        count = int(step)
    args = LookupArgs.from_flat(values, offsets, per_sample_weights, table_meta, output_dim,
                                block_size, hash_mode, hash_params, bounds_check)
    args.backward_fused_(grad_output, weights, state1, state2, optimizer, hparams, count)


@counted_backward_fused_.register_fake
def _counted_backward_fused_fake(*args) -> None:
    return None
