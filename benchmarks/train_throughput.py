"""Training throughput of the Hydra app: DLRM with full embeddings (TorchRec's
EmbeddingBagCollection, FBGEMM TBE once sharded) against ROBE-Z at 1000x, same data,
pipeline, optimizer and machine; the runs alternate (full, robe, full, robe, ...) so load
changes on a shared machine hit both alike.

Each run is ``python -m robe_torchrec.train`` (or ``torchrun --nproc-per-node N``) in its own
run directory; its samples/s is the median over its log windows after the first (warm-up),
read from the run's ``metrics.csv``: on a machine shared with other jobs a window that
another process interrupts is an outlier, not a shift of the mean. Each process uses
``--threads`` threads (default 1: with 2 threads on 2 shared cores, one descheduled thread
stalls every parallel loop, and the spread between identical runs reached 10x).
Synthetic batches are pre-generated per rank (``data.cycle``) so that generating them (slower
than a step at this size) is not measured.
The project's target: ROBE-Z >= 1.5x the full model's samples/s.

``--cache-sized-scale S`` adds a third run to each round: full tables at cardinality scale
``S`` (small enough to stay in cache), same model, batch and pipeline. Its samples/s over the
full model's is what the step gains when the tables' memory traffic goes away; their lookups
still cost something, so embeddings that cost nothing would gain a little more.

Usage::

    python -m benchmarks.train_throughput \\
        --out benchmarks/results/train_throughput.md
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from robe_torchrec.pipelines.report import machine, machine_line, write_report

TARGET = 1.5


# run name -> (embedding config, whether its tables are the cache-sized ones)
RUNS = {"full": ("full", False), "robe": ("robe", False), "cache_sized": ("full", True)}


def _command(args, run: str, run_dir: Path) -> List[str]:
    embedding, cache_sized = RUNS[run]
    scale = args.cache_sized_scale if cache_sized else args.cardinality_scale
    overrides = [
        f"embedding={embedding}", f"embedding.dim={args.dim}",
        f"run.steps={args.steps}", f"run.batch_size={args.batch_size}",
        f"run.log_every={args.log_every}", "run.eval_batches=0", "run.test_batches=0",
        "run.progress_bar=false", f"data.cardinality_scale={scale}",
        f"data.cycle={args.cycle}", f"pipeline={args.pipeline}", f"hydra.run.dir={run_dir}",
        f"run.threads={args.threads}",
        *args.overrides,
    ]
    if embedding == "robe":
        overrides.append(f"embedding.compression={args.compression}")
    if args.nproc > 1:
        return [str(Path(sys.executable).parent / "torchrun"), "--standalone",
                "--nproc-per-node", str(args.nproc), "-m", "robe_torchrec.train", *overrides]
    return [sys.executable, "-m", "robe_torchrec.train", *overrides]


def samples_per_s(run_dir: Path) -> float:
    """Median samples/s of an app run's train windows after the first one."""
    rows = [r for r in csv.DictReader(open(run_dir / "metrics.csv")) if r["phase"] == "train"]
    return statistics.median(float(r["samples_per_s"]) for r in rows[1:])


def run_app(cmd: List[str], run_dir: Path) -> float:
    """Run one app command writing into ``run_dir``; its :func:`samples_per_s` (exits with the
    command's output if it fails)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return samples_per_s(run_dir)


def log_line(run_dir: Path, marker: str) -> str:
    """The message of the first line of an app run's log that contains ``marker``."""
    for line in open(run_dir / "train.log"):
        if marker in line:
            return line.split(" - ", 1)[1].strip()
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--cardinality-scale", type=float, default=0.1)
    p.add_argument("--compression", type=float, default=1000)
    p.add_argument("--cycle", type=int, default=8, help="pre-generated batches per rank")
    p.add_argument("--pipeline", default="sparse_dist")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--cache-sized-scale", type=float, default=None,
                   help="add a run with full tables at this cardinality scale (cache-sized)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    args = p.parse_args()

    runs = ["full", "robe"] + (["cache_sized"] if args.cache_sized_scale is not None else [])
    rates: Dict[str, List[float]] = {run: [] for run in runs}
    lines: Dict[str, str] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for emb in runs:
                run_dir = Path(tmp) / f"{emb}_{r}"
                t = time.perf_counter()
                rates[emb].append(run_app(_command(args, emb, run_dir), run_dir))
                lines[emb] = log_line(run_dir, "embeddings (")
                print(f"round {r} {emb:4s}: {rates[emb][-1]:9,.0f} samples/s "
                      f"(run {time.perf_counter() - t:.0f} s)", flush=True)
                load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["robe"] / med["full"]
    verdict = "met" if ratio >= TARGET else "missed"
    cache_sized = med["cache_sized"] / med["full"] if "cache_sized" in med else None
    print(f"median: full {med['full']:,.0f}, robe {med['robe']:,.0f} samples/s; "
          f"ratio {ratio:.2f}x (target >= {TARGET}x: {verdict})"
          + (f"; cache-sized full tables {cache_sized:.2f}x" if cache_sized is not None else ""))
    if args.out is None:
        return
    shown = " ".join(sys.argv[1:])
    report = [
        f"# Training throughput: ROBE-Z {args.compression:g}x vs full embeddings (Hydra app)",
        "",
        f"Command: `python -m benchmarks.train_throughput {shown}`",
        "",
        f"Machine: {machine_line()}; load average (1 min) "
        f"during the runs {min(load):.1f}-{max(load):.1f} (the machine is shared).",
        "",
        f"Setup: DLRM (TorchRec), 26 Criteo-like tables at cardinality scale "
        f"{args.cardinality_scale}, dim {args.dim}, {args.nproc} process(es) x {args.threads} "
        f"thread(s), batch "
        f"{args.batch_size} per rank, pipeline `{args.pipeline}`, fused Adagrad on the "
        f"embeddings, Adagrad on the dense layers; {args.steps} steps per run; a run's samples/s "
        f"is the median of its {args.log_every}-step windows after the first; runs "
        f"alternate, {args.rounds} rounds; the ratio is of the medians over rounds.",
        "",
        f"- full: {lines.get('full', '')}",
        f"- robe: {lines.get('robe', '')}",
        *([f"- cache_sized: full tables at cardinality scale {args.cache_sized_scale}: "
           f"{lines.get('cache_sized', '')}"] if cache_sized is not None else []),
        "",
        "| run | " + " | ".join(f"round {r}" for r in range(args.rounds)) + " | median |",
        "|---|" + "---:|" * (args.rounds + 1),
    ]
    for emb in runs:
        report.append(f"| {emb} | " + " | ".join(f"{x:,.0f}" for x in rates[emb])
                      + f" | {med[emb]:,.0f} |")
    report += ["", f"**ROBE-Z / full = {ratio:.2f}x** (target >= {TARGET}x: **{verdict}**)", ""]
    if cache_sized is not None:
        report += [f"Full tables small enough to stay in cache (scale {args.cache_sized_scale}) "
                   f"/ full = **{cache_sized:.2f}x**: what this step gains when the tables' "
                   "memory traffic goes away. Their lookups still cost something, so embeddings "
                   "that cost nothing would gain a little more.", ""]
    result = {"machine": machine(), "command": shown, "args": {**vars(args), "out": str(args.out)},
              "samples_per_s": rates, "median_samples_per_s": med, "ratio": ratio,
              "cache_sized_ratio": cache_sized,
              "load_average": load}
    write_report(args.out.parent, args.out.stem, result, "\n".join(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.json').name}")


if __name__ == "__main__":
    main()
