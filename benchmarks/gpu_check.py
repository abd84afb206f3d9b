"""Does the GPU path work, and how fast is it? The Triton kernels checked against the
reference on CUDA tensors, then timed at the paper's setting (:mod:`benchmarks.gpu_speed`),
in one call and one results file. Needs torch and Triton only, so it runs on a bare GPU image.

Speed: one id a bag and ``--ids-per-bag``, against the one-call full table and one
``nn.EmbeddingBag`` call a table, then the paper's one-table setting.

Checks: ``robe_torchrec.testing.op_checks.triton_checks`` and, on CUDA, ``gpu_checks`` (a
random-configuration matrix, no host sync, CUDA graphs) and ``gpu_torchrec_checks`` (a
compiled TorchRec DLRM, where torchrec imports), each ok or
FAILED with its error; exit status 0, 1 when one failed, 2 without a device. ``--cpu`` runs
it in Triton's interpreter at tiny sizes (what CI runs; timings mean nothing);
``--profile-launches`` only makes the launches Nsight Compute profiles::

    python -m benchmarks.gpu_check --out benchmarks/results/gpu_check_h100.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks.common import DeviceTimer, command_line, header, parser, publish, table

#: launch variants timed beside the default with one id a bag (tuning fields): each (id,
#: block) pair hashed once, in a tile of its own, with several bags a program to fill it
#: (benchmarks/results/kernel_instructions.md counts their instructions), and several bags a
#: program without it (which of the two any gain comes from)
ONE_ID_VARIANTS = {"": {}, "4 bags a program": {"bags_per_program": 4},
                   "compact hash, 4 bags a program": {"compact_hash": True,
                                                      "bags_per_program": 4},
                   "compact hash, 8 bags a program": {"compact_hash": True,
                                                      "bags_per_program": 8},
                   "compact hash, 8 bags a program, 2 warps": {
                       "compact_hash": True, "bags_per_program": 8, "num_warps": 2}}
#: the same with several ids a bag: the two-pass default against one pass, with and
#: without the compact hash, the short-bags kernel walking long bags in step, and the
#: two-pass kernels' warps (2 beat 4 at b357f85; 1 is untried)
VARIANTS = {"": {}, "one pass": {"two_pass_mean_bag": float("inf")},
            "one pass, ids 4 a step": {"two_pass_mean_bag": float("inf"), "tile": 512},
            "one pass, compact hash": {"two_pass_mean_bag": float("inf"), "compact_hash": True},
            "short bags, compact hash, 8 bags a program": {
                "short_bag_mean": float("inf"), "compact_hash": True, "bags_per_program": 8},
            "two-pass, ids 16 a step": {"two_pass_tile": 2048},
            "two-pass, 1 warp": {"num_warps": 1}, "two-pass, 4 warps": {"num_warps": 4}}
#: ids a bag of the multi-hot scenario (the issue's setting)
IDS_PER_BAG = 20
#: timed at every bag length (and run in the CPU mode): the weight gradient summed in a fixed
#: order, what torch.use_deterministic_algorithms(True) selects on CUDA; every launch through
#: JITFunction.run, as before the cached launches (the host time they save)
ALWAYS = {"deterministic backward": {"deterministic_backward": True},
          "launched via JITFunction.run": {"cached_launch": False}}


def run_checks(device: str, quick: bool, only: Optional[str], matrix: int,
               on_check: Callable[[List[dict]], None] = lambda results: None,
               budget_s: Optional[float] = None) -> List[Dict[str, object]]:
    """Every check (``only``: those whose name contains it), each failure reported and the
    rest still run; ``on_check`` gets the results so far after each. Once ``budget_s``
    seconds have gone, the checks left are listed as not run (the speed section after them
    keeps its time within a session's limit)."""
    from robe_torchrec.testing.op_checks import triton_checks

    checks = triton_checks(device, quick=quick)
    if device == "cuda":
        from robe_torchrec.testing.gpu_checks import (compiled_checks, matrix_checks,
                                                      sync_and_graph_checks)
        from robe_torchrec.testing.gpu_torchrec_checks import torchrec_gpu_checks

        # the sync and graph checks first: before anything compiles (see
        # sync_and_graph_checks), and first to report if the session's time runs out; then
        # the ops' (whose deferred-check messages name their problem, before their
        # torch_compile check), TorchRec's (its DLRM compiled with CUDA graphs), the matrix
        checks = (sync_and_graph_checks() + checks + compiled_checks()
                  + torchrec_gpu_checks() + matrix_checks(matrix))
    results = []
    began = time.perf_counter()
    for name, check in [(n, c) for n, c in checks if not only or only in n]:
        start, error = time.perf_counter(), ""
        if budget_s is not None and start - began > budget_s:
            results.append({"name": name, "ok": None, "not_run": True, "seconds": 0.0,
                            "error": f"not run: the checks' {budget_s:.0f} s had gone"})
            continue
        try:
            check()
        except Exception as exc:  # noqa: BLE001  a failure is reported, the rest still run
            error = " ".join(traceback.format_exception_only(type(exc), exc))
            error = " ".join(error.split())[:400]
            print(traceback.format_exc(), flush=True)  # where it failed, for the log
            restore_after_failure(name)
        results.append({"name": name, "ok": not error, "seconds": time.perf_counter() - start,
                        "error": error})
        print(f"  check {name:40s} {'FAILED' if error else 'ok'} ({results[-1]['seconds']:.1f} s) "
              f"{error}", flush=True)
        on_check(results)
    return results


def restore_after_failure(name: str) -> None:
    """What a check that raised may have left behind for the checks after it: the sync
    debug mode it set, a capture's stream still current (``torch.cuda.graph`` leaves it so
    when its capture fails), and, after a compiled check, Dynamo's caches and Inductor's
    CUDA graph trees."""
    if not torch.cuda.is_available():
        return
    torch.cuda.set_sync_debug_mode("default")
    if torch.cuda.current_stream() != torch.cuda.default_stream():
        print(f"  (check {name} left stream {torch.cuda.current_stream()} current: back to "
              "the default stream)", flush=True)
        torch.cuda.set_stream(torch.cuda.default_stream())
    if "compiled" in name:
        torch._dynamo.reset()


def speed(args: argparse.Namespace, device: torch.device,
          on_section: Callable[[List[str], List[dict]], None] = lambda lines, results: None):
    """``(lines, results)``: one id a bag, then several, then one table; ``on_section`` gets
    what is done after each of the first two."""
    from benchmarks import gpu_speed
    from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES

    cpu = device.type == "cpu"  # the interpreter runs each program in Python: a few bags
    batch, dim = (4, 16) if cpu else (args.batch, 128)
    cards = [1000, 24, 300] if cpu else list(CRITEO_KAGGLE_CARDINALITIES)
    zs, compression = ([4, 16], 10.0) if cpu else ([32, 128], args.compression)
    reps, inner, warmup = (2, 1, 0) if cpu else (args.reps, args.inner, 3)
    timer, lines, results = DeviceTimer(device), [], []
    for per_bag in (1, args.ids_per_bag):
        s = gpu_speed.Scenario(f"{per_bag} id(s) a bag", batch, dim, cards, per_bag, zs,
                               compression)
        variants = {**({"": {}} if cpu else VARIANTS if per_bag > 1 else ONE_ID_VARIANTS),
                    **ALWAYS}
        more, result = gpu_speed.run_scenario(s, device, timer, reps, inner, warmup, variants,
                                              reference_reps=2 if cpu else max(3, reps // 10))
        lines, results = lines + more, results + [result]
        print("\n".join(more[:20]), flush=True)
        on_section(lines, results)
    sizes = [1000, 4000] if cpu else [int(n) for n in args.single_table]
    more, rows = gpu_speed.single_table(device, timer, reps, inner, sizes,
                                        [10.0, 100.0] if cpu else [10, 100, 1000, 10000],
                                        batch, dim, zs[0])
    lines, results = lines + more, results + [{"scenario": "one table", "rows": rows}]
    if not cpu:
        lines.append(f"Peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB.")
    return lines, results


def profile_launches(ids_per_bag: int, block_size: int = 32) -> None:
    """The launches Nsight Compute profiles: forward and fused SGD at the paper's setting,
    one id a bag (also with the deterministic backward) and ``ids_per_bag``, each twice (the
    first call compiles; ncu skips nothing by itself)."""
    from benchmarks.gpu_speed import HPARAMS, Lookup, Scenario
    from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES
    from robe_torchrec.ops import raise_pending_checks
    from robe_torchrec.ops.meta import Optimizer
    from robe_torchrec.ops.tuning import tuned

    # 20 launches at one id a bag (the second variant: hash, pool, ordered gradient, step;
    # the third: the compact hash, 8 bags a program), 10 at several (two passes each way):
    # the 30 the profile takes
    compact = {"compact_hash": True, "bags_per_program": 8}
    for per_bag, variants in ((1, [{}, {"deterministic_backward": True}, compact]),
                              (ids_per_bag, [{}])):
        lk = Lookup(Scenario("profile", 10240, 128, list(CRITEO_KAGGLE_CARDINALITIES), per_bag,
                             [block_size], 1000.0), torch.device("cuda"))
        weights, args = lk.robe(block_size)
        values, offsets, _, meta, _, z, hash_mode, params, _ = args
        state = torch.zeros_like(weights)
        for tuning in variants:
            with torch.no_grad(), tuned(**tuning):
                for _ in range(2):
                    torch.ops.robe.forward(weights, *args)
                    torch.ops.robe.backward_fused_(
                        lk.grad, weights, state, state.new_empty(0), values, offsets, None, meta,
                        z, hash_mode, params, int(Optimizer.SGD), HPARAMS, 1)
        torch.cuda.synchronize()
        raise_pending_checks()
        print(f"profiled {per_bag} id(s) a bag, variants {variants}", flush=True)


def select_device(cpu: bool) -> Optional[torch.device]:
    """CPU (the whole process in Triton's interpreter) or CUDA; None, said on stderr, when
    neither can run."""
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported
        from robe_torchrec.ops import triton_kernels

        if triton_kernels.interpreted():
            return torch.device("cpu")
        print("gpu_check --cpu: triton was imported before TRITON_INTERPRET=1 could be set",
              file=sys.stderr)
    elif torch.cuda.is_available():
        return torch.device("cuda")
    else:
        print("gpu_check: no CUDA device; run with --cpu for the interpreter smoke test",
              file=sys.stderr)
    return None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = parser("gpu_check", __doc__)
    p.add_argument("--cpu", action="store_true", help="CPU tensors, Triton's interpreter (CI)")
    p.add_argument("--out", default=None, help="results file (.md; .json beside it)")
    p.add_argument("--batch", type=int, default=10240)
    p.add_argument("--compression", type=float, default=1000.0)
    p.add_argument("--reps", type=int, default=30, help="timed samples per row")
    p.add_argument("--inner", type=int, default=5, help="calls per timed sample")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--only", default=None, help="run only the checks whose name contains this")
    p.add_argument("--matrix", type=int, default=24, help="random configurations (CUDA only)")
    p.add_argument("--checks-budget", type=float, default=None,
                   help="seconds after which the checks left are listed as not run")
    p.add_argument("--ids-per-bag", type=int, default=IDS_PER_BAG,
                   help="ids a bag of the multi-hot rows")
    p.add_argument("--profile-launches", action="store_true", help="only the launches ncu profiles")
    p.add_argument("--single-table", nargs="*", default=[4e6, 32e6, 256e6], type=float,
                   help="rows of the one-table rows (the paper's 4M to 256M)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    device = select_device(args.cpu)
    if device is None:
        return 2
    if args.profile_launches:
        profile_launches(args.ids_per_bag)
        return 0

    def report(checks: List[dict], speed_lines: List[str], speed_results: List[dict],
               left: str = "") -> List[str]:
        """Write the report of what has run; ``left`` names what has not (a partial
        report, in case a time limit cuts the run short)."""
        lines = report_lines(args, argv, device, time.perf_counter() - start, checks,
                             speed_lines, left)
        publish(args.out, "gpu_check", lines,
                {"command": command_line("gpu_check", argv), "device": device_name(device),
                 "checks": checks, "speed": speed_results, "incomplete": left},
                echo=not left)
        return [c["name"] for c in checks if c["ok"] is False]

    checks = [] if args.skip_checks else run_checks(
        str(device), args.cpu, args.only, args.matrix,
        lambda done: report(done, [], [], left="the rest of the checks"), args.checks_budget)
    if args.skip_speed:
        failed = report(checks, [], [])
    else:
        report(checks, [], [], left="the speed section")
        speed_lines, speed_results = speed(
            args, device, lambda lines, results: report(checks, lines, results,
                                                        left="the rest of the speed section"))
        failed = report(checks, speed_lines, speed_results)
    # checks left out by --checks-budget are not a pass either
    return 1 if failed or any(c.get("not_run") for c in checks) else 0


def device_name(device: torch.device) -> str:
    return (torch.cuda.get_device_name(device) if device.type == "cuda"
            else "CPU, Triton interpreter")


def report_lines(args: argparse.Namespace, argv: Sequence[str], device: torch.device,
                 seconds: float, checks: List[dict], speed_lines: List[str],
                 left: str = "") -> List[str]:
    """The report: header, checks, speed; ``left``: what had not run when it was written."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not importable"
    failed = [c["name"] for c in checks if c["ok"] is False]
    not_run = [c["name"] for c in checks if c.get("not_run")]
    lines = header("GPU check: Triton kernels against the reference, and their speed",
                   command_line("gpu_check", argv),
                   f"device: {device_name(device)}; CUDA {torch.version.cuda}, triton "
                   f"{triton_version}; "
                   f"{'CPU mode, tiny sizes: the timings mean nothing; ' if args.cpu else ''}"
                   f"wall time {seconds:.0f} s"
                   + (f"; INCOMPLETE: written before {left} had run" if left else "")
                   + (f"; INCOMPLETE: {len(not_run)} checks not run (--checks-budget)"
                      if not_run else ""))
    ran = len(checks) - len(not_run)
    lines += ["## Checks", "", f"{ran - len(failed)} of {ran} passed"
              + (f"; FAILED: {', '.join(failed)}" if failed else "")
              + (f"; {len(not_run)} not run (--checks-budget): {', '.join(not_run)}"
                 if not_run else ""), "",
              *table(["check", "result", "seconds", "error"],
                     [[c["name"], "not run" if c.get("not_run") else "ok" if c["ok"]
                       else "FAILED", f"{c['seconds']:.1f}", c["error"]] for c in checks])]
    return lines + (["", "## Speed", "", *speed_lines] if speed_lines else [])


if __name__ == "__main__":
    sys.exit(main())
