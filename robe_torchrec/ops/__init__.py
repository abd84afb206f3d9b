"""ROBE-Z custom ops, registered with ``torch.library`` in the ``robe`` namespace.

=====================================  ======================================================
``torch.ops.robe.forward``             pooled lookup of T features -> ``[B, output_dim]``
``torch.ops.robe.backward_dense``      gradient of the flat ROBE weights (size M)
``torch.ops.robe.per_sample_weights_grad``  gradient of the per-sample weights
``torch.ops.robe.backward_fused_``     scatter the gradient and apply SGD/Adagrad/Adam in place
``torch.ops.robe.counted_backward_fused_``  the same, counting the step in a tensor
``torch.ops.robe.unpooled_keys``       an unpooled lookup's ids as keys, for a traced graph
=====================================  ======================================================

Argument conventions are documented in :mod:`robe_torchrec.ops.meta`. Each op has three
implementations with one signature:

* :mod:`robe_torchrec.ops.cpu`: multithreaded C++ (``at::parallel_for``), JIT-built once
  and cached; the kernel for CPU tensors.
* :mod:`robe_torchrec.ops.triton_kernels`: Triton; the kernel for CUDA tensors, and runs on
  CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests it).
* :mod:`robe_torchrec.ops.reference`: plain PyTorch, the test oracle.

:mod:`robe_torchrec.ops.dense_update` applies an optimizer step from a dense gradient (the
data-parallel path; torch.optim's functional steps), :mod:`robe_torchrec.ops.args` holds the
arguments as one structure (:class:`LookupArgs`).

On CUDA tensors the Triton ops read their input checks' answer after they return, so that
the host never waits for the GPU (:mod:`robe_torchrec.ops.deferred_checks`:
:func:`defer_checks`, :func:`raise_pending_checks`, ``ROBE_DEFER_CHECKS``).

For CPU tensors the implementation can be switched (tests, benchmarks) with
:func:`cpu_backend` or the ``ROBE_CPU_BACKEND`` environment variable
(``cpp`` | ``triton`` | ``reference``). ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``
set before triton is first imported (the test suite's ``conftest.py`` does this when no GPU is
present).

Every op has a fake (meta) implementation, so ``torch.compile`` traces through it, and
``forward`` is differentiable (weights and per-sample weights).

Python callers pass the arguments as one :class:`~robe_torchrec.ops.args.LookupArgs`
(``args.forward(weights)``), built from the module's layout; the registered signatures stay flat.

Example::

    >>> out = torch.ops.robe.forward(weights, values, offsets, None, meta, 24, 4, 0, params, 0)
    >>> out.sum().backward()   # weights.grad from robe::backward_dense
    >>> args = LookupArgs(values, offsets, None, LayoutArgs(meta, 24, 4, 0, params, 0))
    >>> out = args.forward(weights)                     # the same call
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from robe_torchrec.ops import meta
from robe_torchrec.ops.args import LayoutArgs, LookupArgs
from robe_torchrec.ops.backends import (checks_deferred, cpu_backend, cpu_implementation,
                                        cuda_implementation)
from robe_torchrec.ops.deferred_checks import (DeferredCheckError, defer_checks,
                                               raise_pending_checks)
from robe_torchrec.ops.feature_names import name_in_error
from robe_torchrec.ops.validation import check_shapes_only, check_static

#: the ``robe`` namespace. Every op is defined with ``torch.library.define`` and its kernels
#: registered with ``torch.library.impl``, not with ``torch.library.custom_op``: a call then
#: goes from the dispatcher straight to the kernel, without ``custom_op``'s per-call Python
#: layer (an aliasing check, a TorchDynamo guard): 13 us of host time a forward on a quiet
#: CPU core (``benchmarks/results/history/host_overhead_9bc96fe.md``), and a GPU forward at
#: the paper's setting waits on its host.
_LIB = torch.library.Library("robe", "FRAGMENT")


def _name_feature(err: Exception, table_meta: Tensor) -> None:
    """Name the feature an op's error gives by index (:mod:`~robe_torchrec.ops.feature_names`),
    unless the error is a deferred check's: that one is about another call's input, and
    names its features itself."""
    if not isinstance(err, DeferredCheckError):
        name_in_error(err, table_meta)


def _table_meta_position(name: str) -> int:
    op = getattr(torch.ops.robe, name).default
    return [arg.name for arg in op._schema.arguments].index("table_meta")


def _define(schema: str, fake: Callable[..., object]) -> None:
    """Define ``robe::<schema>``: its CPU kernel (the implementation :func:`cpu_backend`
    picks), its CUDA kernel (Triton) and its fake kernel; their errors name the feature."""
    name = schema.split("(", 1)[0]
    qualname = f"robe::{name}"
    _LIB.define(schema)
    at = _table_meta_position(name)

    def cpu_kernel(*args):
        try:
            return getattr(cpu_implementation(), name)(*args)
        except (ValueError, RuntimeError) as err:
            _name_feature(err, args[at])
            raise

    def cuda_kernel(*args):
        try:
            return getattr(cuda_implementation(), name)(*args)
        except (ValueError, RuntimeError) as err:
            _name_feature(err, args[at])
            raise

    torch.library.impl(qualname, "cpu", cpu_kernel, lib=_LIB)
    torch.library.impl(qualname, "cuda", cuda_kernel, lib=_LIB)
    torch.library.register_fake(qualname, fake, lib=_LIB)


# ---------------------------------------------------------------------------------------
# robe::forward
# ---------------------------------------------------------------------------------------

def _forward_fake(weights, values, offsets, per_sample_weights, table_meta, output_dim,
                  block_size, hash_mode, hash_params, bounds_check) -> Tensor:
    # (check_static names a meta input beside the weights; this, the rest of the mix)
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    check_shapes_only(weights, values, offsets, per_sample_weights, table_meta)
    batch = (offsets.shape[0] - 1) // table_meta.shape[1]
    return weights.new_empty(batch, output_dim, dtype=meta.accumulation_dtype(weights.dtype))


_define("forward(Tensor weights, Tensor values, Tensor offsets, Tensor? per_sample_weights, "
        "Tensor table_meta, SymInt output_dim, SymInt block_size, SymInt hash_mode, "
        "SymInt[] hash_params, SymInt bounds_check) -> Tensor", _forward_fake)


class _ForwardFunction(torch.autograd.Function):
    """The autograd node of ``robe::forward``: its forward runs the op's kernel below the
    autograd keys, its backward the two gradient ops. The layout's six arguments come as
    one tuple: ``apply`` walks every argument it is given twice (once in Python, once in
    C++), host time a training forward waits on."""

    @staticmethod
    def forward(ctx, keyset, weights, values, offsets, per_sample_weights, layout):  # type: ignore[override]
        output = _forward_below_autograd(keyset, weights, values, offsets, per_sample_weights,
                                         *layout)
        table_meta, output_dim, block_size, hash_mode, hash_params, bounds_check = layout
        ctx.save_for_backward(weights, values, offsets, per_sample_weights, table_meta)
        # the tensor travels through save_for_backward, the rest of the layout on ctx (the
        # hash parameters copied: the caller's list may change before the backward)
        ctx.layout = (output_dim, block_size, hash_mode, list(hash_params), bounds_check)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        weights, values, offsets, per_sample_weights, table_meta = ctx.saved_tensors
        args = LookupArgs(values, offsets, per_sample_weights,
                          LayoutArgs(table_meta, *ctx.layout))
        # needs_input_grad[0] is the dispatch key set's
        grad_weights = grad_psw = None
        if ctx.needs_input_grad[1]:
            grad_weights = args.backward_dense(grad_output, weights)
        if per_sample_weights is not None and ctx.needs_input_grad[4]:
            grad_psw = args.per_sample_weights_grad(grad_output, weights)
        return (None, no_second_derivative(grad_weights, grad_output), None, None,
                no_second_derivative(grad_psw, grad_output), None)


class _NoSecondDerivative(torch.autograd.Function):
    """A gradient of a ROBE lookup, tied to the gradient it was computed from, whose own
    backward raises: the gradient ops have no derivative, and an untied result would be a
    constant whose second derivative reads 0 (TorchRec's ``embedding_bag`` raises there
    too, as this does, when the second backward reaches it)."""

    @staticmethod
    def forward(ctx, result, grad_output):  # type: ignore[override]
        return result.view_as(result)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise NotImplementedError(
            "robe: the gradient of a ROBE lookup cannot be differentiated again (a second "
            "derivative through its weights or per-sample weights); take the ROBE lookup "
            "out of the graph differentiated twice, e.g. detach its output there")


def no_second_derivative(result: Optional[Tensor], grad_output: Tensor) -> Optional[Tensor]:
    """``result``, a gradient computed from ``grad_output`` in a backward, made to raise if
    differentiated (only under ``create_graph=True``, when ``grad_output`` needs a
    gradient; else returned as it is)."""
    if result is None or not (torch.is_grad_enabled() and grad_output.requires_grad):
        return result
    return _NoSecondDerivative.apply(result, grad_output)


def _forward_autograd(keyset, weights, values, offsets, per_sample_weights, *layout):
    if torch.is_grad_enabled() and (weights.requires_grad or (
            per_sample_weights is not None and per_sample_weights.requires_grad)):
        return _ForwardFunction.apply(keyset, weights, values, offsets, per_sample_weights,
                                      layout)
    return _forward_below_autograd(keyset, weights, values, offsets, per_sample_weights,
                                   *layout)


def _forward_below_autograd(keyset, *args) -> Tensor:
    """``robe::forward`` past the autograd keys: for plain CPU or CUDA tensors straight to the
    implementation, else (fake, meta or functional tensors, a dispatch mode) through the
    dispatcher again."""
    below = _BELOW_AUTOGRAD.get(keyset.raw_repr())
    if below is None:
        below = keyset & torch._C._after_autograd_keyset
        if len(_BELOW_AUTOGRAD) < 64:  # the few key sets a process calls with
            _BELOW_AUTOGRAD[keyset.raw_repr()] = below
    implementation = _PLAIN_KEYS.get(below.raw_repr())
    with torch._C._AutoDispatchBelowAutograd():
        if implementation is not None:
            try:
                return implementation().forward(*args)
            except (ValueError, RuntimeError) as err:
                _name_feature(err, args[_FORWARD_TABLE_META])
                raise
        return _FORWARD.redispatch(below, *args)


_FORWARD = torch.ops.robe.forward.default
#: a call's dispatch key set (raw) -> what is left of it below autograd
_BELOW_AUTOGRAD: dict = {}
#: table_meta's place in robe::forward's arguments past the dispatch key set
_FORWARD_TABLE_META = _table_meta_position("forward")
#: what is left of a plain CPU or CUDA tensor's dispatch keys below autograd (the backend,
#: with or without ADInplaceOrView, a fallthrough for this op), and the implementation the
#: dispatcher would reach from there: calling it directly saves a second trip through the
#: dispatcher, 5.6 of the 43.1 us a no-grad Triton forward's host work took on a CPU core
#: (launches stubbed, benchmarks/results/history/host_overhead_9bc96fe.md)
_PLAIN_KEYS = {
    keys.raw_repr(): impl
    for backend, impl in ((torch._C.DispatchKey.CPU, cpu_implementation),
                          (torch._C.DispatchKey.CUDA, cuda_implementation))
    for keys in (torch._C.DispatchKeySet(backend),
                 torch._C.DispatchKeySet(backend).add(torch._C.DispatchKey.ADInplaceOrView))
}
# robe::forward's autograd kernel, registered as torch.library.register_autograd does (the
# same private dispatch guard and key set) but without its generic layer: that layer
# rebuilds the schema's argument list for each of the op's ten arguments on every call
# (torch._library.utils.fill_defaults): recording the graph took 50 us a call that way
# against 20 us with this kernel, on a CPU core where the Triton wrapper's own host work
# took 27 us (benchmarks/results/history/host_overhead_9bc96fe.md)
_LIB.impl("forward", _forward_autograd, "Autograd", with_keyset=True)


# ---------------------------------------------------------------------------------------
# robe::backward_dense, robe::per_sample_weights_grad
# ---------------------------------------------------------------------------------------

def _backward_dense_fake(grad_output, weights, *rest) -> Tensor:
    check_shapes_only(grad_output, weights, *rest)
    return torch.empty_like(weights, dtype=meta.accumulation_dtype(weights.dtype))


_define("backward_dense(Tensor grad_output, Tensor weights, Tensor values, Tensor offsets, "
        "Tensor? per_sample_weights, Tensor table_meta, SymInt block_size, SymInt hash_mode, "
        "SymInt[] hash_params) -> Tensor", _backward_dense_fake)


def _psw_grad_fake(grad_output, weights, values, *rest) -> Tensor:
    check_shapes_only(grad_output, weights, values, *rest)
    return weights.new_empty(values.shape[0], dtype=meta.accumulation_dtype(weights.dtype))


_define("per_sample_weights_grad(Tensor grad_output, Tensor weights, Tensor values, "
        "Tensor offsets, Tensor table_meta, SymInt block_size, SymInt hash_mode, "
        "SymInt[] hash_params) -> Tensor", _psw_grad_fake)


# ---------------------------------------------------------------------------------------
# robe::backward_fused_, robe::counted_backward_fused_
# ---------------------------------------------------------------------------------------
#
# The ops that write their arguments: the schema marks what they write (``Tensor(a!)``, what
# torch.compile functionalizes), and their ADInplaceOrView kernel bumps the version of every
# tensor they wrote (autograd and the input checks' caches see the change), as
# ``torch.library.custom_op`` does but without its generic layer, which rebuilt the 14-argument
# list on every call (``torch._library.utils.fill_defaults``, about 55 us a call under
# cProfile). A fused step (forward and fused backward ops) took 90 us of host time against
# 58 us calling the implementations directly, launches stubbed on a CPU core
# (benchmarks/results/history/host_overhead_d2ccb7b.md); behind custom_op it took 201 us, in
# a run where the forward's wrapper took 27 us against 19.9 us in that one
# (results/history/host_overhead_9bc96fe.md).

def _define_mutating(schema: str, written: Tuple[str, ...],
                     cpu_kernel: Callable[..., None], cuda_kernel: Callable[..., None]) -> None:
    """Define ``robe::<schema>``, an op that writes the arguments named in ``written`` and
    returns nothing: its CPU and CUDA kernels, a fake kernel, and the version bump."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    op = getattr(torch.ops.robe, name).default
    positions = [i for i, arg in enumerate(op._schema.arguments) if arg.name in written]
    assert len(positions) == len(written), (schema, written)

    # past this key a plain CPU or CUDA tensor has only its backend key left: call its kernel
    # directly (no second trip through the dispatcher); anything else (meta or fake tensors,
    # a dispatch mode) dispatches again
    plain = {torch._C.DispatchKeySet(key).raw_repr(): kernel
             for key, kernel in ((torch._C.DispatchKey.CPU, cpu_kernel),
                                 (torch._C.DispatchKey.CUDA, cuda_kernel))}

    at = _table_meta_position(name)

    def write_and_bump(keyset, *args):
        below = keyset & torch._C._after_ADInplaceOrView_keyset
        kernel = plain.get(below.raw_repr())
        with torch._C._AutoDispatchBelowADInplaceOrView():
            if kernel is not None:
                try:
                    kernel(*args)
                except (ValueError, RuntimeError) as err:
                    _name_feature(err, args[at])
                    raise
            else:
                op.redispatch(below, *args)
        for i in positions:
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])

    torch.library.impl(f"robe::{name}", "cpu", cpu_kernel, lib=_LIB)
    torch.library.impl(f"robe::{name}", "cuda", cuda_kernel, lib=_LIB)
    torch.library.register_fake(f"robe::{name}", lambda *args: None, lib=_LIB)
    with warnings.catch_warnings():  # torch warns once that this key takes a kernel
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        _LIB.impl(name, write_and_bump, "ADInplaceOrView", with_keyset=True)


def _backward_fused_cpu(*args) -> None:
    cpu_implementation().backward_fused_(*args)


def _backward_fused_cuda(*args) -> None:
    cuda_implementation().backward_fused_(*args)


_define_mutating(
    "backward_fused_(Tensor grad_output, Tensor(a1!) weights, Tensor(a2!) state1, "
    "Tensor(a3!) state2, Tensor values, Tensor offsets, Tensor? per_sample_weights, "
    "Tensor table_meta, SymInt block_size, SymInt hash_mode, SymInt[] hash_params, "
    "SymInt optimizer, float[] hparams, SymInt step, Tensor? lr=None) -> ()",
    ("weights", "state1", "state2"), _backward_fused_cpu, _backward_fused_cuda)


def _counted_on_host(implementation, grad_output, weights, state1, state2, step, optimizer,
                     hparams, values, offsets, per_sample_weights, table_meta, block_size,
                     hash_mode, hash_params, lr=None) -> None:
    """Run ``implementation``'s ``backward_fused_`` with the next count of ``step`` (if
    any, read on the host), then advance it: a call that raises leaves it as it was."""
    count = 1 if step is None else int(step) + 1
    implementation.backward_fused_(grad_output, weights, state1, state2, values, offsets,
                                   per_sample_weights, table_meta, block_size, hash_mode,
                                   hash_params, optimizer, hparams, count, lr)
    if step is not None:
        step += 1


def _counted_backward_fused_cpu(*args) -> None:
    _counted_on_host(cpu_implementation(), *args)


def _counted_backward_fused_cuda(grad_output, weights, state1, state2, step, *rest) -> None:
    """A count on the weights' device stays there; one on the CPU is read as on the CPU."""
    if step is not None and step.device == weights.device:
        cuda_implementation().counted_backward_fused_(grad_output, weights, state1, state2,
                                                      step, *rest)
    else:
        _counted_on_host(cuda_implementation(), grad_output, weights, state1, state2, step,
                         *rest)


#: ``robe::backward_fused_`` that counts the update in ``step``, the optimizer's scalar step
#: tensor (``None``: an optimizer without one; the count is then 1), unless it raises. The
#: count stays a tensor up to here, so a compiled backward carries it as data instead of
#: reading it on the host. A step on the CPU (``torch.optim``'s default) is read inside this
#: op and passed on as an int (:func:`_counted_on_host`). A step on the CUDA weights' device
#: (a capturable optimizer's) is advanced and read there by the Triton kernels, and taken
#: back when a deferred check's guard stops the update
#: (:func:`robe_torchrec.ops.triton_kernels.counted_backward_fused_`): nothing waits for the
#: device, and a CUDA graph replays the count too, which fused Adam needs.
_define_mutating(
    "counted_backward_fused_(Tensor grad_output, Tensor(a1!) weights, Tensor(a2!) state1, "
    "Tensor(a3!) state2, Tensor(a4!)? step, SymInt optimizer, float[] hparams, "
    "Tensor values, Tensor offsets, Tensor? per_sample_weights, Tensor table_meta, "
    "SymInt block_size, SymInt hash_mode, SymInt[] hash_params, Tensor? lr=None) -> ()",
    ("weights", "state1", "state2", "step"), _counted_backward_fused_cpu,
    _counted_backward_fused_cuda)


# the ops as module attributes (torch.ops.robe.<name>), as ``robe_torchrec.ops.<name>``
forward = torch.ops.robe.forward
backward_dense = torch.ops.robe.backward_dense
per_sample_weights_grad = torch.ops.robe.per_sample_weights_grad
backward_fused_ = torch.ops.robe.backward_fused_
counted_backward_fused_ = torch.ops.robe.counted_backward_fused_


__all__ = [
    "DeferredCheckError",
    "LayoutArgs",
    "LookupArgs",
    "backward_dense",
    "backward_fused_",
    "checks_deferred",
    "counted_backward_fused_",
    "cpu_backend",
    "defer_checks",
    "forward",
    "meta",
    "per_sample_weights_grad",
    "raise_pending_checks",
    "no_second_derivative",
    "robe_unpooled_lookup",
]


# the unpooled lookup is robe::forward with one id per bag (no op of its own)
from robe_torchrec.ops.unpooled import robe_unpooled_lookup  # noqa: E402
