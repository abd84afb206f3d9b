"""Host time of a ROBE-Z op call on the Triton path, layer by layer, measured on a CPU.

At the GPU benchmark's setting the forward is host-bound: on an H200 the host spends longer
issuing a call than the GPU spends running it (``benchmarks/results/triton_tiles_h200.md``).
That host time is Python and torch work, so it can be measured without a GPU: this benchmark
makes the same calls on CPU tensors through the Triton implementation
(``cpu_backend("triton")``, checks deferred as on CUDA) with every Triton launch replaced by
a no-op. What it times is what the GPU's host runs too (the wrapper's checks and bookkeeping,
``torch.library``'s dispatch layers, autograd), less Triton's launcher, the CUDA driver
calls and the pinned copy of the deferred checks' answer.

Rows, microseconds per call (median of ``--reps`` samples of ``--calls`` calls each):

* ``wrapper``: ``triton_kernels.forward`` called directly;
* ``op, no grad``: ``torch.ops.robe.forward`` under ``torch.no_grad`` (weights requiring
  grad, as a module's parameter);
* ``op, with grad``: the same call recording the autograd graph;
* ``op + backward``: that forward and ``backward`` of a fixed output gradient;
* ``fused step``: the no-grad forward and ``torch.ops.robe.backward_fused_`` (Adagrad): the
  training path with the optimizer in the backward;
* ``custom_op, no grad`` / ``custom_op, with grad``: the same kernel behind a
  ``torch.library.custom_op`` registration (a namespace of this benchmark's own), against
  which ``robe::forward``'s ``torch.library.define`` + ``torch.library.impl`` registration is
  measured: the two registrations side by side in one process;
* ``register_autograd, no grad`` / ``register_autograd, with grad``: the same kernel defined
  as ``robe::forward`` is, its autograd registered with ``torch.library.register_autograd``
  (as ``robe::forward``'s was before it got an autograd kernel of its own);
* ``op, ... dispatched twice``: ``robe::forward`` with its autograd kernel going through the
  dispatcher again to reach the implementation, as it does for fake or meta tensors, instead
  of calling it directly as it does for plain ones;
* ``wrapper, summary kernel``: the wrapper with its input checks in the summary kernel, as
  before the forward kernel counted them (on a GPU that is also one more Triton launch).

Setting: 26 features of dim 128, one id per bag, Z = 32 (the GPU benchmark's), batch 2048
(the host's work does not depend on it; a larger output would be allocated afresh by the CPU
allocator every call) and an array of 65,536 floats (nor on that; a large one adds the CPU's
own zeroing of the gradient). Samples of every row are interleaved, with Python's garbage
collector off while timing.

Example::

    python -m benchmarks.host_overhead --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import types
import unittest.mock
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

BATCH, FEATURES, DIM, BLOCK_SIZE, MEMORY = 2048, 26, 128, 32, 65536
ROWS = ("wrapper", "op, no grad", "op, with grad", "op + backward", "fused step",
        "custom_op, no grad", "custom_op, with grad", "register_autograd, no grad",
        "register_autograd, with grad", "op, no grad, dispatched twice",
        "op, with grad, dispatched twice", "wrapper, summary kernel")


class _NoLaunch:
    """A Triton kernel whose launches do nothing: ``kernel[grid](*args)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Inside the block every Triton launch of the ops does nothing (on any device)."""
    from robe_torchrec.ops import triton_kernels

    stub = types.SimpleNamespace(**{name: _NoLaunch() for name in dir(triton_kernels)
                                    if name.endswith("_kernel")})
    # the one place the Triton ops fetch their kernels
    with unittest.mock.patch.object(triton_kernels, "_kernels_for", lambda device: stub):
        yield


def _custom_op_forward():
    """``robe::forward``'s kernel behind a ``torch.library.custom_op`` (namespace
    ``robe_host_ab``), with an autograd registration that saves what robe's saves."""
    from robe_torchrec.ops import triton_kernels

    if hasattr(torch.ops.robe_host_ab, "forward"):
        return torch.ops.robe_host_ab.forward

    @torch.library.custom_op("robe_host_ab::forward", mutates_args=())
    def forward(weights: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                output_dim: int, block_size: int, hash_mode: int, hash_params: List[int],
                bounds_check: int) -> torch.Tensor:
        return triton_kernels.forward(weights, values, offsets, per_sample_weights,
                                      table_meta, output_dim, block_size, hash_mode,
                                      hash_params, bounds_check)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.layout = inputs[5:]

    def backward(ctx, grad):
        raise NotImplementedError("timing only")

    forward.register_autograd(backward, setup_context=setup_context)
    return torch.ops.robe_host_ab.forward


def _register_autograd_forward():
    """``robe::forward``'s schema and kernel (namespace ``robe_host_ra``), its autograd
    registered with ``torch.library.register_autograd``: torch's generic autograd kernel."""
    from robe_torchrec.ops import triton_kernels

    if hasattr(torch.ops.robe_host_ra, "forward"):
        return torch.ops.robe_host_ra.forward
    lib = defining_library("robe_host_ra", forward_schema())
    lib.impl("forward", triton_kernels.forward, "CPU")

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:5])
        ctx.layout = inputs[5:]

    def backward(ctx, grad):
        raise NotImplementedError("timing only")

    torch.library.register_autograd("robe_host_ra::forward", backward,
                                    setup_context=setup_context, lib=lib)
    return torch.ops.robe_host_ra.forward


_LIBRARIES: List[torch.library.Library] = []


def forward_schema() -> str:
    """``robe::forward``'s schema without its namespace, to define an op just like it."""
    return str(torch.ops.robe.forward.default._schema).split("::", 1)[1]


def defining_library(namespace: str, schema: str) -> torch.library.Library:
    """A library of this process that defines ``schema`` in ``namespace`` (kept alive here:
    a library's registrations last as long as the object)."""
    lib = torch.library.Library(namespace, "DEF")
    _LIBRARIES.append(lib)
    lib.define(schema)
    return lib


def calls() -> Dict[str, Callable[[], object]]:
    """One call of each row, on CPU tensors (run them under :func:`stubbed_launches`)."""
    from robe_torchrec.hashing import HashMode, hash_params
    from robe_torchrec.ops import cpu_backend, defer_checks, triton_kernels
    from robe_torchrec.ops.meta import BoundsCheck, Optimizer, Pooling, build_table_meta

    g = torch.Generator().manual_seed(0)
    cards = [100_000] * FEATURES
    ids = torch.randint(0, cards[0], (FEATURES * BATCH,), generator=g)
    offsets = torch.arange(ids.numel() + 1)
    meta = build_table_meta([DIM] * FEATURES, [0] * FEATURES, [MEMORY] * FEATURES,
                            [sum(cards[:t]) for t in range(FEATURES)], cards,
                            [int(Pooling.SUM)] * FEATURES)
    params = hash_params(HashMode.REFERENCE, seed=1024)
    flat = (ids, offsets, None, meta, DIM * FEATURES, BLOCK_SIZE, int(HashMode.REFERENCE),
            params, int(BoundsCheck.ERROR))
    weights = torch.empty(MEMORY).uniform_(-0.01, 0.01, generator=g).requires_grad_(True)
    fused_weights, state = weights.detach().clone(), torch.zeros(MEMORY)
    grad = torch.randn(BATCH, DIM * FEATURES, generator=g)
    custom_op = _custom_op_forward()
    register_autograd = _register_autograd_forward()

    @contextlib.contextmanager
    def triton_path(grad_mode: bool = True):
        with cpu_backend("triton"), defer_checks(True), torch.set_grad_enabled(grad_mode):
            yield

    def wrapper():
        with triton_path(False):
            return triton_kernels.forward(fused_weights, *flat)

    counts_in_kernel = triton_kernels._counts_in_kernel

    def wrapper_with_summary():
        # the forward's checks by the summary kernel, as before the forward kernel counted
        # them (set and restored by hand: a mock.patch context would cost more than it saves)
        triton_kernels._counts_in_kernel = lambda *args: False
        try:
            return wrapper()
        finally:
            triton_kernels._counts_in_kernel = counts_in_kernel

    def dispatched_twice(call):
        # without the plain key sets, the autograd kernel finds no direct implementation
        # (set and restored by hand, as below)
        import robe_torchrec.ops as ops

        def run():
            plain = dict(ops._PLAIN_KEYS)
            ops._PLAIN_KEYS.clear()
            try:
                return call()
            finally:
                ops._PLAIN_KEYS.update(plain)
        return run

    def op(fn, grad_mode):
        def call():
            with triton_path(grad_mode):
                return fn(weights, *flat)
        return call

    def op_backward():
        weights.grad = None
        with triton_path():
            torch.ops.robe.forward(weights, *flat).backward(grad)

    def fused_step():
        with triton_path(False):
            torch.ops.robe.forward(fused_weights, *flat)
            torch.ops.robe.backward_fused_(grad, fused_weights, state, state.new_empty(0),
                                           ids, offsets, None, meta, BLOCK_SIZE,
                                           int(HashMode.REFERENCE), params,
                                           int(Optimizer.ADAGRAD), [0.01, 1e-8, 0.9, 0.999, 0.0],
                                           1)

    return dict(zip(ROWS, (wrapper, op(torch.ops.robe.forward, False),
                           op(torch.ops.robe.forward, True), op_backward, fused_step,
                           op(custom_op, False), op(custom_op, True),
                           op(register_autograd, False), op(register_autograd, True),
                           dispatched_twice(op(torch.ops.robe.forward, False)),
                           dispatched_twice(op(torch.ops.robe.forward, True)),
                           wrapper_with_summary)))


def measure(reps: int, per_sample: int) -> Dict[str, List[float]]:
    """``reps`` samples of each row (microseconds per call), rows interleaved."""
    from benchmarks.cpu_ops import keep_freed_memory

    from robe_torchrec.ops import raise_pending_checks

    keep_freed_memory()  # the outputs reuse freed blocks, as a GPU's caching allocator does
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fns = calls()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    with stubbed_launches():
        for fn in fns.values():  # warm-up: caches of checked metadata, first-call work
            for _ in range(3):
                fn()
        gc.collect()
        gc.disable()  # as timeit: a collection would land on whichever call triggers it
        try:
            for _ in range(reps):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    for _ in range(per_sample):
                        fn()
                    samples[name].append((time.perf_counter() - start) / per_sample * 1e6)
        finally:
            gc.enable()
            torch.set_num_threads(threads)
        raise_pending_checks()
    return samples


def render(result: Dict[str, object]) -> str:
    med: Dict[str, float] = result["medians"]  # type: ignore[assignment]
    low: Dict[str, float] = result["lower_quartiles"]  # type: ignore[assignment]
    lines = [
        "# Host time of a ROBE-Z op call on the Triton path (launches stubbed, CPU)",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']}",
        f"- date: {result['date']}; load average at start {result['load'][0]:.2f}, "
        f"at end {result['load'][1]:.2f}",
        f"- setting: batch {BATCH}, {FEATURES} features of dim {DIM}, one id per bag, "
        f"Z = {BLOCK_SIZE}, array {MEMORY:,} floats; checks deferred; 1 thread; "
        f"{result['reps']} samples of {result['calls']} calls per row, interleaved",
        "",
        "Microseconds per call. What the host of a GPU also runs, less Triton's launcher, the "
        "CUDA driver calls and the deferred checks' pinned copy.",
        "",
        "| row | median | lower quartile |",
        "|---|---|---|",
    ]
    lines += [f"| {row} | {med[row]:.1f} | {low[row]:.1f} |" for row in ROWS]
    lines += [
        "",
        f"- torch.library's layers around the wrapper, no grad (op - wrapper): "
        f"{med['op, no grad'] - med['wrapper']:.1f} us a call with robe's "
        f"`define` + `impl` registration, {med['custom_op, no grad'] - med['wrapper']:.1f} us "
        f"behind `custom_op` (same kernel, same run)",
        f"- recording the autograd graph (with grad - no grad): "
        f"{med['op, with grad'] - med['op, no grad']:.1f} us a call with robe's registration, "
        f"{med['custom_op, with grad'] - med['custom_op, no grad']:.1f} us behind `custom_op`, "
        f"{med['register_autograd, with grad'] - med['register_autograd, no grad']:.1f} us "
        f"with torch.library.register_autograd's generic autograd kernel",
        f"- the autograd kernel calling the implementation directly: the op takes "
        f"{med['op, no grad']:.1f} us a call without grad and {med['op, with grad']:.1f} us "
        f"with, against {med['op, no grad, dispatched twice']:.1f} and "
        f"{med['op, with grad, dispatched twice']:.1f} us through the dispatcher again "
        f"(the dict copy and restore those rows add is under 1 us)",
        f"- the forward's checks counted by its own kernel: the wrapper takes "
        f"{med['wrapper']:.1f} us a call, {med['wrapper, summary kernel']:.1f} us with the "
        f"summary kernel's host work (its launch not counted)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40, help="samples per row")
    parser.add_argument("--calls", type=int, default=20, help="calls per sample")
    parser.add_argument("--out", help="folder for host_overhead.{md,json}; printed if not given")
    args = parser.parse_args(argv)

    from robe_torchrec.pipelines.report import machine_line, write_report

    load_start = os.getloadavg()[0]
    samples = measure(args.reps, args.calls)
    result: Dict[str, object] = {
        "command": "python -m benchmarks.host_overhead "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": [load_start, os.getloadavg()[0]], "reps": args.reps, "calls": args.calls,
        "medians": {row: statistics.median(v) for row, v in samples.items()},
        "lower_quartiles": {row: statistics.quantiles(v, n=4)[0] for row, v in samples.items()},
        "samples_us": samples,
    }
    markdown = render(result)
    if args.out:
        write_report(args.out, "host_overhead", result, markdown)
    print(markdown)
    return result


if __name__ == "__main__":
    main()
