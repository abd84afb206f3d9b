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
this backward: the forward takes an *anchor*, an empty leaf that requires grad and stands
for the array. The array steps when the backward pass reaches the array (or the anchor):
a plain ``loss.backward()`` does, and so does one whose ``inputs`` name the array;
``torch.autograd.grad`` of other tensors (the per-sample weights alone, say) does not, as a
stock table's in-backward optimizer runs only when its weight's gradient is accumulated.
Make one with :func:`autograd_anchor` on the array's device: a sharded lookup with no
features makes its empty output from it, which must be on the device its output dist runs
on.

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

from robe_torchrec.ops import no_second_derivative
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
    if anchor is None:
        anchor = _CPU_ANCHOR
    # the array itself too, where it takes part in autograd (eager mode): a backward pass
    # that names it (loss.backward(inputs=[module.weight, ...])) then reaches it here
    array = weights if weights.requires_grad else None
    return _FusedLookup.apply(anchor, per_sample_weights if psw_needs_grad else None, array,
                              weights.detach(), optimizer, args, all_reduce_group)


def _array_edge(per_sample_weights: Optional[torch.Tensor],
                array: Optional[torch.Tensor]) -> Optional[int]:
    """Which of :class:`_FusedLookup`'s edges (its inputs that are tensors, in order) leads to
    the node whose run says that the backward pass reaches the array: the array's gradient
    accumulator where it requires grad, else the anchor's. ``None`` in a graph that
    ``torch.compile`` traces, which cannot ask the autograd engine: its backward always
    steps. (An index, not the node: looking a leaf's accumulator up is host time that
    every training forward would pay.)"""
    if torch.compiler.is_compiling():
        return None
    return 0 if array is None else 1 + (per_sample_weights is not None)


class _FusedLookup(torch.autograd.Function):
    """The lookup whose backward steps the array. Its inputs that autograd follows are the
    anchor, which stands for the array, the array itself where it requires grad (it never
    gets a gradient), and the per-sample weights when they need one. The array steps only
    when the backward pass reaches the array (or the anchor, where the array does not
    require grad), as a stock table's in-backward optimizer runs only when its weight's
    gradient is accumulated: ``torch.autograd.grad(out, [per_sample_weights])`` or
    ``loss.backward(inputs=[...])`` without the array leave it alone (eager mode; a
    compiled graph always steps it)."""

    @staticmethod
    def forward(ctx, anchor, per_sample_weights, array, weights, optimizer, args, group):  # type: ignore[override]
        ctx.weights, ctx.optimizer, ctx.args, ctx.group = weights, optimizer, args, group
        ctx.array_edge = _array_edge(per_sample_weights, array)
        return args.forward(weights)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        args: LookupArgs = ctx.args
        weights, optimizer = ctx.weights, ctx.optimizer
        grad_psw = None
        if ctx.needs_input_grad[1]:  # before the update: it reads the weights it pooled
            grad_psw = args.per_sample_weights_grad(grad_output, weights)
        edge = ctx.array_edge
        if edge is None or torch._C._will_engine_execute_node(ctx.next_functions[edge][0]):
            _step(args, grad_output, weights, optimizer, ctx.group)
        return None, no_second_derivative(grad_psw, grad_output), None, None, None, None, None


def _step(args: LookupArgs, grad_output: torch.Tensor, weights: torch.Tensor,
          optimizer: RobeFusedOptimizer, group: Optional[dist.ProcessGroup]) -> None:
    """Scatter ``grad_output`` into ``weights`` and apply ``optimizer``, in place: in one op,
    or for a data-parallel array (``group``) after averaging the dense gradient."""
    state1, state2 = optimizer.state_tensors()
    if group is not None and dist.get_world_size(group) > 1:
        grad = args.backward_dense(grad_output, weights)
        dist.all_reduce(grad, group=group)
        grad.div_(dist.get_world_size(group))
        apply_dense_update_(weights, grad, state1, state2, int(optimizer.kind),
                            optimizer.hparams(), optimizer.advance_step(),
                            block_size=args.layout.block_size)
    else:
        rate, hparams = optimizer.rate_and_hparams()
        args.counted_backward_fused_(grad_output, weights, state1, state2,
                                     optimizer.param_state.get("step"),
                                     int(optimizer.kind), hparams, rate)
