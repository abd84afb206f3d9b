"""The C++ CPU kernels of the working tree against those of another git revision, side by side.

A kernel change is judged on this machine by timing both builds in one process, alternating
call by call, so that the load other processes put on the shared cores hits both alike.
The baseline's kernel files (``robe_torchrec/ops/csrc``; one ``robe_cpu.cpp`` in revisions
before the kernels were split by phase) are taken from git (or from a folder, or one file
that replaces its namesake in the working tree's), built as a second extension
with the same flags, and first checked against the working tree's: the report says, per
case and op, whether the two builds give bitwise the same result (the forward's output, the
dense gradient, the weights and Adagrad state after one fused step) or else the largest
difference.

Example::

    python -m benchmarks.kernel_ab --baseline HEAD~1 \\
        --out benchmarks/results

On a busy machine, ``--clock cpu`` (1 thread) times the calling thread's CPU time instead of
wall time, so the time the process spends descheduled does not land on one build's calls.

Cases are the shapes the kernels meet: the app's DLRM (26 features, one id per bag, batch
2048) at dims 12, 16 and 128 and arrays of 43K to 5.4M floats, the CPU benchmark's pair model
and bags of 20 ids. ``--dlrm-memory M ...`` runs the app's DLRM shape (dim 16, Z 8) at the
given array sizes instead; ``--small`` runs tiny shapes (the test suite's check).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from robe_torchrec.pipelines.report import machine, machine_line, nearest_rank, write_report
from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops import cpu
from robe_torchrec.ops.meta import Optimizer, build_table_meta

_CSRC_IN_REPO = "robe_torchrec/ops/csrc"
_ONE_FILE_KERNEL = "robe_cpu.cpp"  # the whole kernel, in revisions before the split by phase
_BENCHMARK_ONLY = {os.path.basename(p) for p in cpu._PARTS_SOURCES if p.endswith(".cpp")}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    features: int
    batch: int
    dim: int
    block_size: int
    memory: int
    ids_per_bag: int = 1


CASES = [
    Case("DLRM dim 16, Z 8, 54K floats (app's 1000x)", 26, 2048, 16, 8, 54_021),
    Case("DLRM dim 16, Z 8, 540K floats (100x)", 26, 2048, 16, 8, 540_208),
    Case("DLRM dim 16, Z 8, 5.4M floats (10x)", 26, 2048, 16, 8, 5_402_080),
    Case("DLRM dim 128, Z 32, 43K floats", 26, 2048, 128, 32, 43_217),
    Case("DLRM dim 12, Z 8 (partial blocks)", 26, 2048, 12, 8, 54_021),
    Case("bags of 20 ids, dim 16, Z 4", 8, 512, 16, 4, 54_021, ids_per_bag=20),
    Case("pair model dim 64, Z 32, 262K floats", 1, 65_536, 64, 32, 262_144),
    Case("pair model dim 64, Z 32, 2.6M floats", 1, 65_536, 64, 32, 2_621_440),
    Case("pair model dim 64, Z 8, 2.6M floats", 1, 65_536, 64, 8, 2_621_440),
]
SMALL_CASES = [
    Case("small: dim 16, Z 8", 4, 64, 16, 8, 2_000),
    Case("small: bags of 5 ids, dim 12, Z 8", 3, 32, 12, 8, 1_000, ids_per_bag=5),
]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", _REPO_ROOT, *args], check=True, capture_output=True,
                          text=True).stdout


def _kernel_files(names: Sequence[str]) -> List[str]:
    """The names among ``names`` that make up the kernels' build: the one-file kernel alone
    where there is one, else every .cpp and .h but the benchmark-only ones."""
    if _ONE_FILE_KERNEL in names:
        return [_ONE_FILE_KERNEL]
    return sorted(n for n in names if n.endswith((".cpp", ".h")) and n not in _BENCHMARK_ONLY)


def baseline_source(revision: Optional[str], path: Optional[str]) -> "tuple[Dict[str, str], str]":
    """The baseline kernel's files (name: text) and a label for it: from git ``revision``, or
    from ``path``, a folder of kernel files or one file (a file named as one of the working
    tree's kernel files replaces it there; any other is a whole one-file kernel)."""
    if path is not None:
        try:
            if os.path.isdir(path):
                names = _kernel_files(os.listdir(path))
                files = {}
                for name in names:
                    with open(os.path.join(path, name)) as f:
                        files[name] = f.read()
                return files, path
            with open(path) as f:
                text = f.read()
        except OSError as err:
            raise SystemExit(f"kernel_ab: cannot read the baseline source {path}: {err}") from None
        current = {os.path.basename(p): p for p in cpu._SOURCES}
        name = os.path.basename(path)
        if name not in current:
            return {_ONE_FILE_KERNEL: text}, path
        files = {}
        for other, other_path in current.items():
            with open(other_path) as f:
                files[other] = f.read()
        files[name] = text
        return files, f"{path} in the working tree's kernel"
    try:
        names = _git("ls-tree", "--name-only", f"{revision}:{_CSRC_IN_REPO}").split()
        files = {name: _git("show", f"{revision}:{_CSRC_IN_REPO}/{name}") for name in _kernel_files(names)}
        sha = _git("rev-parse", "--short", revision).strip()
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        raise SystemExit(f"kernel_ab: cannot read {_CSRC_IN_REPO} at revision {revision!r} "
                         f"from the git checkout at {_REPO_ROOT}: {detail.strip()}") from None
    return files, f"{revision} ({sha})"


def build_baseline(files: Dict[str, str]):
    """Build the kernel ``files`` (name: text) as an extension of its own name (cached by content)."""
    digest = hashlib.sha256("\0".join(f"{n}\0{files[n]}" for n in sorted(files)).encode()).hexdigest()[:12]
    directory = os.path.join(cpu.build_directory(), "kernel_ab", digest)
    os.makedirs(directory, exist_ok=True)
    sources = []
    for name, text in sorted(files.items()):
        if name == _ONE_FILE_KERNEL:
            name = "robe_cpu_baseline.cpp"
        source = os.path.join(directory, name)
        if not os.path.exists(source):  # written whole or not at all: the folder is the content's
            partial = f"{source}.{os.getpid()}.tmp"
            with open(partial, "w") as f:
                f.write(text)
            os.replace(partial, source)
        sources.append(source)
    return cpu.build(f"robe_cpu_baseline_{digest}", sources, directory)


def _inputs(case: Case, seed: int = 0) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(10, 100_000, (case.features,), generator=g).tolist()
    row_offsets = [sum(rows[:t]) for t in range(case.features)]
    meta = build_table_meta(dims=[case.dim] * case.features, weight_offsets=[0] * case.features,
                            weight_sizes=[case.memory] * case.features, row_offsets=row_offsets,
                            num_rows=rows, poolings=[0] * case.features)
    values = torch.cat([torch.randint(0, r, (case.batch * case.ids_per_bag,), generator=g)
                        for r in rows])
    offsets = torch.arange(case.features * case.batch + 1) * case.ids_per_bag
    weights = torch.randn(case.memory, generator=g)
    grad_output = torch.randn(case.batch, case.features * case.dim, generator=g)
    return dict(meta=meta, values=values, offsets=offsets, weights=weights, grad=grad_output)


_ADAGRAD = [0.01, 1e-8, 0.9, 0.999, 0.0]  # lr, eps, beta1, beta2, weight decay


def _fused_step(ext, case: Case, x: Dict[str, Any], hash_mode: HashMode, params: List[int],
                weights: torch.Tensor, state: torch.Tensor) -> None:
    ext.backward_fused_(x["grad"], weights, state, state.new_empty(0), x["values"], x["offsets"], None,
                        x["meta"], case.block_size, int(hash_mode), params,
                        int(Optimizer.ADAGRAD), _ADAGRAD, 1)


def _fused_result(ext, case: Case, x: Dict[str, Any], hash_mode: HashMode) -> torch.Tensor:
    """Weights and Adagrad state after one fused step from the case's weights, zero state."""
    weights, state = x["weights"].clone(), torch.zeros_like(x["weights"])
    _fused_step(ext, case, x, hash_mode, hash_params(hash_mode, 1024), weights, state)
    return torch.cat([weights, state])


def _ops(ext, case: Case, x: Dict[str, Any], hash_mode: HashMode) -> Dict[str, Callable[[], Any]]:
    # the hash's parameters made once, outside the timed calls
    z, mode, params = case.block_size, int(hash_mode), hash_params(hash_mode, 1024)
    updated, state = x["weights"].clone(), torch.zeros_like(x["weights"])
    return {
        "forward": lambda: ext.forward(x["weights"], x["values"], x["offsets"], None, x["meta"],
                                       case.features * case.dim, z, mode, params, 0),
        "fused Adagrad": lambda: _fused_step(ext, case, x, hash_mode, params, updated, state),
        "dense gradient": lambda: ext.backward_dense(x["grad"], x["weights"], x["values"],
                                                     x["offsets"], None, x["meta"], z, mode, params),
    }


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "bitwise equal"
    return f"max abs difference {float((a - b).abs().max()):.3g}"


CLOCKS: Dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_case(baseline, current, case: Case, iters: int, clock: str = "wall",
              hash_mode: HashMode = HashMode.REFERENCE) -> Dict[str, Any]:
    x = _inputs(case)
    base_ops, cur_ops = _ops(baseline, case, x, hash_mode), _ops(current, case, x, hash_mode)
    outputs = {op: _difference(base_ops[op](), cur_ops[op]()) for op in ("forward", "dense gradient")}
    outputs["fused Adagrad"] = _difference(_fused_result(baseline, case, x, hash_mode),
                                           _fused_result(current, case, x, hash_mode))
    row: Dict[str, Any] = {"case": dataclasses.asdict(case), "outputs": outputs, "ops": {}}
    for op in base_ops:
        times: Dict[str, List[float]] = {"baseline": [], "current": []}
        for _ in range(3):
            base_ops[op](), cur_ops[op]()
        for i in range(iters):
            order = [("baseline", base_ops[op]), ("current", cur_ops[op])]
            for label, fn in order if i % 2 == 0 else reversed(order):
                now = CLOCKS[clock]
                start = now()
                fn()
                times[label].append((now() - start) * 1e3)
        base, cur = nearest_rank(times["baseline"], 50), nearest_rank(times["current"], 50)
        row["ops"][op] = {"baseline_ms": base, "current_ms": cur, "ratio": cur / base}
    return row


def render(result: Dict[str, Any]) -> str:
    lines = [
        "# C++ kernels: working tree against a baseline revision, side by side",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {machine_line(result['machine'])}; {result['threads']} thread(s); load "
        f"average (1 min) {result['load'][0]:.2f} at start, {result['load'][1]:.2f} at end "
        "(the machine is shared).",
        "",
        f"Baseline: {result['baseline']}. Each op alternates between the two builds call by "
        f"call, {result['iters']} calls each; medians in ms of "
        + ("the calling thread's CPU time (time.thread_time: time descheduled by other "
           "processes does not count)" if result.get("clock") == "cpu" else "wall time")
        + "; ratio = current / baseline "
        f"(below 1: the working tree is faster). {result.get('hash', 'reference').capitalize()} "
        "hash, sum pooling, ids uniform per table.",
        "",
        "| case | op | baseline | current | ratio | outputs |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        for op, t in row["ops"].items():
            lines.append(f"| {row['case']['name']} | {op} | {t['baseline_ms']:.3f} | "
                         f"{t['current_ms']:.3f} | {t['ratio']:.2f} | {row['outputs'][op]} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--baseline", default="HEAD", help="git revision of the baseline kernel")
    which.add_argument("--baseline-source",
                       help="instead: a folder of kernel files, or one file replacing its namesake "
                            "in the working tree's kernel (any other name: a one-file kernel)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: perf_counter; cpu: the calling thread's CPU time, which "
                             "a busy machine's descheduling does not inflate (1 thread only)")
    parser.add_argument("--dlrm-memory", type=int, nargs="+", metavar="FLOATS",
                        help="instead of the default cases: the app's DLRM shape (dim 16, Z 8) "
                             "with arrays of these sizes")
    parser.add_argument("--hash", choices=["reference", "mix"], default="reference",
                        help="the hash every case uses")
    parser.add_argument("--name", default="kernel_ab", help="stem of the result files")
    parser.add_argument("--out", help="folder for <name>.{md,json}; printed only if not given")
    args = parser.parse_args(argv)

    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu times the calling thread only: use it with --threads 1")
    torch.set_num_threads(args.threads)
    text, label = baseline_source(args.baseline, args.baseline_source)
    baseline, current = build_baseline(text), cpu.extension()
    load_start = os.getloadavg()[0]
    rows = []
    if args.dlrm_memory:
        cases = [Case(f"DLRM dim 16, Z 8, {m:,} floats", 26, 2048, 16, 8, m) for m in args.dlrm_memory]
    else:
        cases = SMALL_CASES if args.small else CASES
    for case in cases:
        rows.append(time_case(baseline, current, case, args.iters, args.clock,
                              HashMode.MIX if args.hash == "mix" else HashMode.REFERENCE))
        ops = ", ".join(f"{op} {t['ratio']:.2f}" for op, t in rows[-1]["ops"].items())
        print(f"{case.name}: current / baseline: {ops}", flush=True)
    result = {
        "command": "python -m benchmarks.kernel_ab " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(), "threads": args.threads, "iters": args.iters, "baseline": label,
        "clock": args.clock, "hash": args.hash,
        "load": [load_start, os.getloadavg()[0]], "rows": rows,
    }
    markdown = render(result)
    if args.out:
        write_report(args.out, args.name, result, markdown)
    else:
        print(markdown)
    return result


if __name__ == "__main__":
    main()
