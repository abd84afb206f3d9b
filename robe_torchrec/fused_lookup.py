"""A ROBE lookup whose backward applies the optimizer in place (the fused path).

Shared by the unsharded module and the sharded lookups, so the in-backward update is written
once: per-sample-weight gradient first (it must see the weights before the update), then
either ``robe::backward_fused_`` (scatter and update in one go, through
``robe::counted_backward_fused_``, which also counts the step) or, for a
data-parallel array, the dense gradient averaged over the process group and then the update
(:func:`robe_torchrec.ops.dense_update.apply_dense_update_`).

The unsharded path compiles (``torch.compile(fullgraph=True)``): the backward reads no
tensor on the host, the step counter stays a tensor until the op reads it.

The array an optimizer updates here enters the lookup detached, as FBGEMM's fused tables do
not take part in autograd: no gradient ever reaches it. (Its module takes it out of
autograd altogether for a compiled graph: an array that required grad, written in the
backward, is what torch 2.11's AOTAutograd refuses to compile, "a leaf Variable that
requires grad is being used in an in-place operation", pytorch/pytorch#178622; in eager
mode its ``requires_grad`` stays the user's, off meaning frozen.) Autograd still calls
this backward: the forward takes an *anchor*, an empty leaf that requires grad (or the
per-sample weights, when they need a gradient). Make one with :func:`autograd_anchor` on the
array's device: a sharded lookup with no features makes its empty output from it, which
must be on the device its output dist runs on.

Example::

    >>> args = LookupArgs(values, offsets, None, module.layout.op_args(module.table_meta))
    >>> anchor = autograd_anchor(module.weight.device)
    >>> pooled = fused_lookup(module.weight, module.fused_optimizer, args, anchor)
    >>> pooled.sum().backward()    # module.weight was updated, it has no .grad
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from robe_torchrec.ops.args import LookupArgs
from robe_torchrec.ops.dense_update import apply_dense_update_
from robe_torchrec.optim import RobeFusedOptimizer


def autograd_anchor(device: torch.device | str) -> torch.Tensor:
    """An empty leaf on ``device`` that requires grad and never gets a gradient: the input
    that makes autograd run :func:`fused_lookup`'s backward. Make it outside a compiled
    region (a compiled graph cannot create a leaf that requires grad) and keep it."""
    return torch.empty(0, device=device, requires_grad=True)


_CPU_ANCHOR = autograd_anchor("cpu")


def fused_lookup(
    weights: torch.Tensor,
    optimizer: RobeFusedOptimizer,
    args: LookupArgs,
    anchor: Optional[torch.Tensor] = None,
    all_reduce_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Pooled lookup of ``args`` in ``weights``; backward updates ``weights`` with ``optimizer``.

    ``anchor``: an :func:`autograd_anchor` on the array's device (a CPU one when ``None``).
    With ``all_reduce_group``, the array's gradient is averaged over that group before the
    update (data-parallel arrays: every rank holds the array and sees its own batch).
    """
    per_sample_weights = args.per_sample_weights
    psw_needs_grad = per_sample_weights is not None and per_sample_weights.requires_grad
    # autograd calls backward only if an input requires grad
    if psw_needs_grad:
        anchor = per_sample_weights
    elif anchor is None:
        anchor = _CPU_ANCHOR
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

