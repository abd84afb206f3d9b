"""Host time of each layer a ``robe::forward`` call passes through, on the device's host.

The GPU benchmarks show the forward at the paper's setting limited by its host on some
machines (``docs/benchmarks.md``, "Results on an NVIDIA H200"). This splits the host's time
per call into the layers between the caller and the Triton kernel, and times reference
calls beside them, so that machines of different host speed can be compared:

* ``registered op ...``: ``torch.ops.robe.forward`` under ``no_grad`` (weights requiring
  grad, as a module's parameter, and not);
* ``through the dispatcher twice``: the op's autograd layer as ``torch.library`` builds it,
  a second trip through the dispatcher to the backend key (what ``robe::forward`` did before
  it called its implementation directly for plain tensors);
* ``implementation``: the Triton wrapper (CUDA) or the C++ op (CPU) called directly;
* ``Triton wrapper, launches stubbed``: the Triton wrapper with every kernel launch a no-op
  (on a GPU, implementation minus this is the time Triton's launcher takes on the host);
* reference calls: an op of the same ten-argument schema whose Python kernel returns its
  input, a one-argument one, ``torch.add`` of 4-element tensors, a 4-element ``torch.zeros``
  (the forward makes one for its checks' counts), and 1000 additions in Python.

Microseconds per call, median of ``--reps`` samples of ``--calls`` calls, rows interleaved;
on a GPU the device is synchronized before each sample, so a sample times the host alone
when the host limits the calls. Needs torch (and Triton on a GPU) only::

    python -m benchmarks.host_layers --out benchmarks/results/host_layers_h200.md

``--cpu`` runs it on CPU tensors (the C++ op) at batch 64.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from benchmarks.gpu_check import _criteo_ids, gpu_setting, publish, robe_inputs
from benchmarks.host_overhead import defining_library, forward_schema, stubbed_launches

STUBBED = "Triton wrapper, launches stubbed"


def _noop_ops():
    """Two ops whose Python kernels return their first input: ``robe::forward``'s schema
    (namespace ``robe_host_layers``) and a one-argument one."""
    if not hasattr(torch.ops.robe_host_layers, "forward"):
        for namespace, schema in (("robe_host_layers", forward_schema()),
                                  ("robe_host_layers_one", "noop(Tensor x) -> Tensor")):
            lib = defining_library(namespace, schema)
            for key in ("CPU", "CUDA"):
                lib.impl(schema.split("(", 1)[0], lambda first, *rest: first, key)
    return torch.ops.robe_host_layers.forward, torch.ops.robe_host_layers_one.noop


def rows(device: torch.device, batch: int) -> Dict[str, Callable[[], object]]:
    # the implementation robe::forward reaches for each device
    from robe_torchrec.ops import cpu, triton_kernels

    setting = gpu_setting(argparse.Namespace(batch=batch, compression=1000.0, reps=1, inner=1))
    inputs = robe_inputs(setting, _criteo_ids(setting, device), device, 32)
    weights, flat = inputs.weights, inputs.flat
    trainable = weights.detach().clone().requires_grad_(True)
    backend = torch._C.DispatchKey.CUDA if device.type == "cuda" else torch._C.DispatchKey.CPU
    backend_keys = torch._C.DispatchKeySet(backend)
    implementation = triton_kernels if device.type == "cuda" else cpu
    ten_args, one_arg = _noop_ops()
    small, small_cpu = torch.ones(4, device=device), torch.ones(4)

    def twice_through_the_dispatcher():
        # the autograd layer's work when it redispatched: guard, key set, dispatcher again
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.robe.forward.default.redispatch(backend_keys, weights, *flat)

    return {
        "registered op, no_grad, weights requiring grad":
            lambda: torch.ops.robe.forward(trainable, *flat),
        "registered op, no_grad": lambda: torch.ops.robe.forward(weights, *flat),
        "through the dispatcher twice": twice_through_the_dispatcher,
        "implementation": lambda: implementation.forward(weights, *flat),
        STUBBED: lambda: triton_kernels.forward(weights, *flat),  # measure() stubs its launches
        "op of the same schema returning its input": lambda: ten_args(weights, *flat),
        "one-argument op returning its input, device tensor": lambda: one_arg(small),
        "one-argument op returning its input, CPU tensor": lambda: one_arg(small_cpu),
        "torch.add of 4-element device tensors": lambda: torch.add(small, small),
        "torch.add of 4-element CPU tensors": lambda: torch.add(small_cpu, small_cpu),
        "torch.zeros of 4 int64s on the device":
            lambda: torch.zeros(4, dtype=torch.int64, device=device),
        "pure Python: 1000 additions": lambda: sum(range(1000)),
    }


def _context(name: str) -> ContextManager:
    """What a row's sample runs in: the stubbed launches for that row (entered once per
    sample, outside the timed calls), nothing for the others."""
    return stubbed_launches() if name == STUBBED else contextlib.nullcontext()


def measure(device: torch.device, batch: int, reps: int, calls: int) -> Dict[str, List[float]]:
    from robe_torchrec.ops import raise_pending_checks

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fns = rows(device, batch)
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for name, fn in fns.items():
            with _context(name):
                for _ in range(5):
                    fn()
        for _ in range(reps):
            for name, fn in fns.items():
                with _context(name):
                    sync()
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    samples[name].append((time.perf_counter() - start) / calls * 1e6)
        sync()
    raise_pending_checks()
    return samples


def report(argv: Sequence[str], device: torch.device, batch: int,
           samples: Dict[str, List[float]], reps: int, calls: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    med = {row: statistics.median(v) for row, v in samples.items()}
    lines = ["# Host time of the layers of a robe::forward call", "",
             f"- command: `{' '.join(shlex.quote(a) for a in ['python', '-m', 'benchmarks.host_layers', *argv])}`",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- device: {name}; torch {torch.__version__}, Python {platform.python_version()}",
             f"- setting: batch {batch}, 26 features of dim 128, one id per bag, Z = 32; "
             f"{reps} samples of {calls} calls per row, interleaved", "",
             "| row | host us per call |", "|---|---|"]
    lines += [f"| {row} | {us:.1f} |" for row, us in med.items()]
    layers = med["registered op, no_grad"] - med["implementation"]
    lines += ["", f"- the layers above the implementation (registered op, no_grad - "
              f"implementation): {layers:.1f} us; through the dispatcher twice instead: "
              f"{med['through the dispatcher twice'] - med['implementation']:.1f} us for that "
              f"part alone"]
    if device.type == "cuda":
        lines.append(f"- Triton's launcher (implementation - {STUBBED}): "
                     f"{med['implementation'] - med[STUBBED]:.1f} us a call; the wrapper's own "
                     f"host work, its CUDA calls included: {med[STUBBED]:.1f} us")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_layers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors, the C++ op")
    parser.add_argument("--out", default=None, help="results file (markdown)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("host_layers: no CUDA device; run with --cpu", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    batch = 64 if args.cpu else 10240
    samples = measure(device, batch, args.reps, args.calls)
    text = report(argv, device, batch, samples, args.reps, args.calls)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
