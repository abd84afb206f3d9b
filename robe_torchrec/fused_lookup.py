"""A ROBE lookup whose backward applies the optimizer in place (the fused path).

Shared by the unsharded module and the sharded lookups, so the in-backward update is written
once: per-sample-weight gradient first (it must see the weights before the update), then
either ``robe::backward_fused_`` (scatter and update in one go, through
``robe::counted_backward_fused_``, which also counts the step) or, for a
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

from typing import Optional

import torch
import torch.distributed as dist

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
            args.counted_backward_fused_(grad_output, weights, state1, state2,
                                         optimizer.param_state.get("step"),
                                         int(optimizer.kind), optimizer.hparams())
        return grad_psw, None, None, None, None, None

