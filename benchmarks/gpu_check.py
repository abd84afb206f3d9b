"""The GPU path proven in one call: the Triton kernels checked against the reference on CUDA
tensors, then timed at the paper's setting against ``nn.EmbeddingBag`` and a pure-PyTorch
ROBE-Z, all written to one results file.

Needs torch and Triton only (and numpy, which :mod:`robe_torchrec.hashing` uses): no torchrec,
fbgemm, hydra or pytest, so it runs on a bare GPU image. Two parts:

1. **checks**: every check of :func:`robe_torchrec.testing.op_checks.triton_checks` (forward, dense
   gradient, both kernels of each, per-sample-weight gradient, each fused optimizer,
   int32/int64 ids, empty and long bags, mixed dims, bad input refused at the call and by a
   deferred check before a fused update, the registered op with autograd,
   ``torch.compile``), each reported as ok/FAILED with its error;
2. **speed** at batch 10240, dim 128, the 26 Criteo Kaggle tables (one id per bag, ids
   uniform in each table), SUM pooling, float32, int64 ids:

   * ``nn.EmbeddingBag``: 26 full tables (33.8 M rows, 17.3 GB), one call per table (the
     outputs are not concatenated), sparse gradients;
   * ``ROBE-Z triton``: ``torch.ops.robe.forward`` (one launch for the 26 features, output
     ``[B, 26 * 128]``; the input checks included, as every caller pays them, deferred as
     they are by default on CUDA), one shared array ``--compression`` times smaller than the
     tables, reference hash, Z = 32 and 128; backward = ``robe::backward_dense``;
   * ``ROBE-Z triton, checks read at the call``: the same with ``defer_checks(False)``
     (the host waits for the checks' answer in every op);
   * ``ROBE-Z triton + fused Adagrad``: the same forward, then ``robe::backward_fused_``
     (the in-backward Adagrad step the module runs under ``apply_optimizer_in_backward``:
     array and state updated in place, no dense gradient);
   * ``floor``: writing the ``[B, 26 * 128]`` output once (``zero_``), the least any forward
     costs (136 MB at this setting);
   * ``ROBE-Z pytorch``: :mod:`robe_torchrec.ops.reference` on CUDA tensors (autograd for the
     backward), the same array and ids.

   Each row is timed with CUDA events around ``--inner`` calls, ``--reps`` samples taken
   round-robin over the rows (interleaved, so drift hits every row alike; each round starts
   one row later, so no row always follows the same one) after ``--warmup`` calls; the
   median is reported, and beside it the host's time to issue the calls. The first call of a
   row (Triton compilation, cuBLAS/allocator warm-up) is reported separately. Targets:
   forward at most 0.5x ``nn.EmbeddingBag``'s, and at least 40x faster than the
   pure-PyTorch ROBE-Z's.

Run on a GPU (a few minutes on an H100, most of it compiling kernels for the checks)::

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check_h100.md

The CPU mode runs the same code on CPU tensors through Triton's interpreter at tiny sizes (a
smoke test that CI runs; its timings mean nothing)::

    python -m benchmarks.gpu_check --cpu --out /tmp/gpu_check_cpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import sys
import time
import traceback
from typing import Callable, List, Optional, Sequence

import torch

#: forward at most this fraction of nn.EmbeddingBag's time
EMBEDDING_BAG_TARGET = 0.5
#: the pure-PyTorch ROBE-Z forward at least this many times slower than ours
REFERENCE_TARGET = 40.0


@dataclasses.dataclass
class Setting:
    batch: int
    dim: int
    cardinalities: List[int]
    block_sizes: List[int]
    compression: float
    reps: int
    reference_reps: int
    warmup: int
    inner: int


def gpu_setting(args: argparse.Namespace) -> Setting:
    from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES

    return Setting(batch=args.batch, dim=128, cardinalities=list(CRITEO_KAGGLE_CARDINALITIES),
                   block_sizes=[32, 128], compression=args.compression, reps=args.reps,
                   reference_reps=max(3, args.reps // 10), warmup=3, inner=args.inner)


def cpu_setting(args: argparse.Namespace) -> Setting:
    # the interpreter runs each of the B * T programs in Python: a few bags only
    return Setting(batch=4, dim=16, cardinalities=[1000, 24, 300], block_sizes=[4, 16],
                   compression=10.0, reps=2, reference_reps=2, warmup=0, inner=1)


# ---------------------------------------------------------------------------------------
# part 1: correctness
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class CheckResult:
    name: str
    ok: bool
    seconds: float
    error: str = ""


def run_checks(device: str, quick: bool, only: Optional[str],
               matrix: int) -> List[CheckResult]:
    from robe_torchrec.testing.op_checks import triton_checks

    checks = triton_checks(device, quick=quick)
    if device == "cuda":
        from robe_torchrec.testing.gpu_checks import gpu_checks, torchrec_gpu_checks

        checks += gpu_checks(matrix=matrix) + torchrec_gpu_checks()
    results = []
    for name, check in checks:
        if only and only not in name:
            continue
        start = time.perf_counter()
        try:
            check()
            results.append(CheckResult(name, True, time.perf_counter() - start))
        except Exception as exc:  # noqa: BLE001  a failure is reported, the rest still run
            lines = traceback.format_exception_only(type(exc), exc)
            error = " ".join(" ".join(lines).split())[:400]
            results.append(CheckResult(name, False, time.perf_counter() - start, error))
        r = results[-1]
        print(f"  check {r.name:40s} {'ok' if r.ok else 'FAILED'} ({r.seconds:.1f} s) {r.error}",
              flush=True)
    return results


# ---------------------------------------------------------------------------------------
# part 2: speed
# ---------------------------------------------------------------------------------------

class Timer:
    """Milliseconds per call of ``fn`` over ``inner`` back-to-back calls: CUDA events on a GPU
    (the device's time, queued calls overlap with the host), ``perf_counter`` on CPU.
    ``host_ms`` is then the host's time per call to issue them (on a GPU, close to the
    device's time when the host is what limits the calls)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host_ms = float("nan")

    def __call__(self, fn: Callable[[], object], inner: int) -> float:
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            start_s = time.perf_counter()
            for _ in range(inner):
                fn()
            self.host_ms = (time.perf_counter() - start_s) * 1e3 / inner
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / inner
        start_s = time.perf_counter()
        for _ in range(inner):
            fn()
        self.host_ms = (time.perf_counter() - start_s) * 1e3 / inner
        return self.host_ms


def _criteo_ids(setting: Setting, device: torch.device) -> torch.Tensor:
    """``[T * B]`` ids, feature-major (bag ``t * B + b`` holds sample b's id of feature t)."""
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.randint(0, c, (setting.batch,), generator=g)
                      for c in setting.cardinalities]).to(device)


#: lr, eps, beta1, beta2, weight decay of the fused row's Adagrad
_FUSED_ADAGRAD = [0.01, 1e-8, 0.9, 0.999, 0.0]


@dataclasses.dataclass
class RobeInputs:
    """The arguments of ``torch.ops.robe.forward`` after ``weights`` (``flat``), and an
    upstream gradient of its output."""
    weights: torch.Tensor
    flat: tuple
    grad: torch.Tensor


def robe_inputs(setting: Setting, ids: torch.Tensor, device: torch.device,
                block_size: int) -> RobeInputs:
    from robe_torchrec.hashing import HashMode, hash_params
    from robe_torchrec.ops.meta import BoundsCheck, Pooling, build_table_meta

    cards = setting.cardinalities
    num_features = len(cards)
    full = sum(cards) * setting.dim
    memory_size = max(int(full / setting.compression), block_size)
    meta = build_table_meta([setting.dim] * num_features, [0] * num_features,
                            [memory_size] * num_features,
                            [sum(cards[:t]) for t in range(num_features)], cards,
                            [int(Pooling.SUM)] * num_features, device=device)
    weights = torch.empty(memory_size, device=device).uniform_(-0.01, 0.01)
    offsets = torch.arange(ids.numel() + 1, device=device)
    output_dim = setting.dim * num_features
    flat = (ids, offsets, None, meta, output_dim, block_size, int(HashMode.REFERENCE),
            hash_params(HashMode.REFERENCE, seed=1024), int(BoundsCheck.ERROR))
    grad = torch.randn(setting.batch, output_dim, device=device)
    return RobeInputs(weights, flat, grad)


def speed(args: argparse.Namespace, device: torch.device) -> List[str]:
    """The speed half (:mod:`benchmarks.gpu_speed`): one id a bag and ``--ids-per-bag``
    ids a bag at the paper's setting, then the single-table sweep."""
    from benchmarks import gpu_speed

    setting = cpu_setting(args) if args.cpu else gpu_setting(args)
    timer = Timer(device)
    variants = {"": {}} if args.cpu else VARIANTS
    lines = []
    for per_bag in (1, args.ids_per_bag):
        scenario = gpu_speed.Scenario(
            f"{per_bag} id(s) a bag", setting.batch, setting.dim, setting.cardinalities,
            per_bag, setting.block_sizes, setting.compression)
        lines += gpu_speed.run_scenario(
            scenario, device, timer, setting.reps, setting.inner, setting.warmup,
            variants if per_bag > 1 else {"": {}},
            reference_reps=setting.reference_reps)
        print("\n".join(lines[-12:]), flush=True)
    sizes = [1000, 5000] if args.cpu else [4_000_000, 16_000_000, 64_000_000, 256_000_000]
    compressions = [10, 100] if args.cpu else [10, 100, 1000, 10000]
    lines += gpu_speed.single_table_sweep(device, timer, max(3, setting.reps // 3),
                                          setting.inner, sizes, compressions,
                                          batch=setting.batch, dim=setting.dim,
                                          block_size=setting.block_sizes[0])
    if device.type == "cuda":
        lines.append(f"Peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB.")
    return lines


#: launch variants timed beside the default with several ids a bag (tuning fields)
VARIANTS = {
    "": {},
    "one pass": {"two_pass_mean_bag": float("inf")},
    "one pass, ids 4 a step": {"two_pass_mean_bag": float("inf"), "tile": 512},
    "two-pass, ids 16 a step": {"two_pass_tile": 2048},
    "two-pass, 4 warps": {"num_warps": 4},
}


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------

def versions(device: torch.device) -> List[str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not importable"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU ({platform.processor() or platform.machine()}), Triton interpreter")
    return [f"- device: {name}",
            f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}, "
            f"Python {platform.python_version()}, {platform.platform()}"]


def report(args: argparse.Namespace, device: torch.device, checks: List[CheckResult],
           speed_lines: List[str], seconds: float) -> str:
    mode = "CPU mode (Triton interpreter, tiny sizes: the timings mean nothing)" if args.cpu \
        else "GPU"
    lines = ["# GPU check: Triton kernels against the reference, and their speed", "",
             f"- command: `{' '.join(shlex.quote(a) for a in ['python', '-m', 'benchmarks.gpu_check', *args.argv])}`",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
             f"mode: {mode}; wall time {seconds:.0f} s",
             *versions(device), ""]
    failed = [c for c in checks if not c.ok]
    lines += ["## Checks", "",
              f"{len(checks) - len(failed)} of {len(checks)} passed"
              + (f"; FAILED: {', '.join(c.name for c in failed)}" if failed else ""), "",
              "| check | result | seconds | error |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {c.seconds:.1f} | {c.error} |"
              for c in checks]
    if speed_lines:
        lines += ["", "## Speed", ""] + speed_lines
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

def setting_arguments(parser: argparse.ArgumentParser, reps: int) -> None:
    """The options every GPU benchmark here shares: the mode, the results file, the setting
    and the timing."""
    parser.add_argument("--cpu", action="store_true",
                        help="CPU tensors through Triton's interpreter, tiny sizes (CI smoke test)")
    parser.add_argument("--out", default=None, help="results file (markdown)")
    parser.add_argument("--batch", type=int, default=10240)
    parser.add_argument("--compression", type=float, default=1000.0)
    parser.add_argument("--reps", type=int, default=reps, help="timed samples per row")
    parser.add_argument("--inner", type=int, default=5, help="calls per timed sample")


def publish(text: str, out: Optional[str]) -> None:
    """Print a report and, when ``out`` names a file, write it there (its folder made)."""
    print(text, flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def select_device(cpu: bool, prog: str) -> Optional[torch.device]:
    """CPU (whole process in Triton's interpreter) or CUDA; None, said on stderr, when
    neither can run."""
    if cpu:
        # The interpreter is chosen when triton is first imported, for the whole process.
        os.environ["TRITON_INTERPRET"] = "1"
        from robe_torchrec.ops import triton_kernels

        if not triton_kernels._is_interpreted(triton_kernels):
            print(f"{prog} --cpu: triton was imported before TRITON_INTERPRET=1 could be set",
                  file=sys.stderr)
            return None
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{prog}: no CUDA device; run with --cpu for the interpreter smoke test",
              file=sys.stderr)
        return None
    return torch.device("cuda")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description=__doc__.split("\n\n")[0])
    setting_arguments(p, reps=30)
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--only", default=None, help="run only the checks whose name contains this")
    p.add_argument("--matrix", type=int, default=24,
                   help="random configurations of the GPU matrix (CUDA only)")
    p.add_argument("--ids-per-bag", type=int, default=20,
                   help="ids a bag of the multi-hot speed scenario")
    args = p.parse_args(argv)
    args.argv = list(argv)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    device = select_device(args.cpu, "gpu_check")
    if device is None:
        return 2
    print("\n".join(versions(device)), flush=True)
    checks = [] if args.skip_checks else run_checks(str(device), args.cpu, args.only,
                                                    args.matrix)
    speed_lines = [] if args.skip_speed else speed(args, device)
    text = report(args, device, checks, speed_lines, time.perf_counter() - start)
    publish(text, args.out)
    return 1 if any(not c.ok for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
