"""How many samples/s does the training app reach: ROBE-Z against full tables, on 2 processes
under DMP against 1 (``--ranks``), and with each thread count beside a busy core (``--busy``)?

Each run is ``python -m robe_torchrec.train`` (``torchrun`` for several processes); its
samples/s, all ranks, is the median of its log windows after the first (one that another
process interrupts is an outlier, not a shift). Settings alternate over rounds.

* default: full tables against ROBE-Z at ``--compression``, ``--threads`` per process (one
  descheduled thread of two stalls every parallel loop on shared cores); target: ROBE-Z at
  least 1.5x. ``--cache-sized-scale S`` adds full tables small enough to stay in cache.
* ``--ranks``: ROBE-Z, data-parallel, 2 processes of 1 thread (each half the batch) against 1
  process of 1 and of 2 threads.
* ``--busy``: a busy loop pinned to the last usable CPU; ROBE-Z with the app's thread default,
  with ``run.threads=1`` and with torch's default::

    python -m benchmarks.train_throughput --rounds 5 --out benchmarks/results/train_throughput.md
    python -m benchmarks.train_throughput --ranks --rounds 5 --out benchmarks/results
    python -m benchmarks.train_throughput --busy --steps 25 --batch-size 1024 --cycle 4 \\
        --rounds 1 --out benchmarks/results/busy_machine.md
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.common import command_line, header, loadavg, parser, publish, table

TARGET = 1.5
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


Setting = Tuple[int, List[str]]  # processes, the app's overrides


def settings(args: argparse.Namespace) -> Dict[str, Setting]:
    """Each setting's process count and overrides."""
    robe = ["embedding=robe", f"embedding.compression={args.compression}"]
    app = [f"embedding.dim={args.dim}", f"pipeline={args.pipeline}",
           f"data.cardinality_scale={args.cardinality_scale}"]
    if args.busy:
        torch_default = torch.get_num_threads()  # nothing set yet in this process
        return {name: (1, ["embedding=robe", f"run.threads={threads}"]) for name, threads in (
            ("default (chosen)", "null"), ("run.threads=1", 1),
            (f"torch's default ({torch_default})", torch_default))}
    if args.ranks:  # the same global batch: half of it per rank on 2
        one = [*robe, *app, "sharding=data_parallel", f"run.batch_size={args.batch_size}"]
        return {"1 process x 1 thread": (1, [*one, "run.threads=1"]),
                "DMP, 2 processes x 1 thread": (2, [*one[:-1], "run.threads=1",
                                                    f"run.batch_size={args.batch_size // 2}"]),
                "1 process x 2 threads": (1, [*one, "run.threads=2"])}
    runs = {"full": ["embedding=full", *app], "robe": [*robe, *app]}
    if args.cache_sized_scale is not None:
        runs["cache_sized"] = ["embedding=full", *app[:2],
                               f"data.cardinality_scale={args.cache_sized_scale}"]
    return {name: (args.nproc, [f"run.threads={args.threads}", f"run.batch_size={args.batch_size}",
                                *o]) for name, o in runs.items()}


def run_app(args: argparse.Namespace, setting: Setting, run_dir: Path) -> float:
    """One app run's samples/s, over all its ranks (exits with its output if it fails)."""
    nproc, overrides = setting
    app = [f"run.steps={args.steps}", f"run.log_every={args.log_every}", "run.eval_batches=0",
           "run.test_batches=0", "run.progress_bar=false", f"data.cycle={args.cycle}",
           f"hydra.run.dir={run_dir}", *overrides, *args.overrides]
    launcher = ([str(Path(sys.executable).parent / "torchrun"), "--standalone",
                 "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable])
    cmd = launcher + ["-m", "robe_torchrec.train", *app]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == "train"]
    return statistics.median(float(r["samples_per_s"]) for r in rows[1:])


def log_line(run_dir: Path, marker: str) -> str:
    """The message of the first line of an app run's log that contains ``marker``."""
    with open(run_dir / "train.log") as f:
        return next((line.split(" - ", 1)[1].strip() for line in f if marker in line), "")


def measure(args: argparse.Namespace, runs: Dict[str, Setting]):
    """Samples/s per setting and round, each setting's log line, the load averages (with
    ``--busy``, a busy loop holds the last usable CPU meanwhile)."""
    rates: Dict[str, List[float]] = {name: [] for name in runs}
    logged: Dict[str, str] = {}
    load = [loadavg()]
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(max(os.sched_getaffinity(0)))]) \
        if args.busy else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for name in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
                    run_dir = Path(tmp) / f"{r}_{list(runs).index(name)}"
                    rates[name].append(run_app(args, runs[name], run_dir))
                    logged[name] = log_line(run_dir, "threads: " if args.busy else "embeddings (")
                    load.append(loadavg())
                    print(f"round {r} {name}: {rates[name][-1]:9,.0f} samples/s; "
                          f"{logged[name]}", flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return rates, logged, load


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    p = parser("train_throughput", __doc__)
    p.add_argument("--busy", action="store_true", help="thread counts beside a busy loop")
    p.add_argument("--ranks", action="store_true", help="2 processes under DMP against 1")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank (--ranks: global)")
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
    p.add_argument("--out", default=None, help="the report (.md), or a folder")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = p.parse_args(argv)
    mode = "busy" if args.busy else "ranks" if args.ranks else "full"
    runs, busy_cpu = settings(args), max(os.sched_getaffinity(0))
    rates, logged, load = measure(args, runs)
    med = {k: statistics.median(v) for k, v in rates.items()}
    first = {"busy": "run.threads=1", "ranks": "1 process x 1 thread", "full": "full"}[mode]
    result = {"command": command_line("train_throughput", argv), "mode": mode, "settings": runs,
              "samples_per_s": rates, "median_samples_per_s": med, "logged": logged,
              "load_average": load, "busy_cpu": busy_cpu if args.busy else None,
              "ratio": med["robe"] / med["full"] if mode == "full" else None,
              "cache_sized_ratio": med["cache_sized"] / med["full"] if "cache_sized" in med
              else None}
    title, stem, what = {
        "busy": ("Thread default on a busy machine (training app)", "busy_machine",
                 f"ROBE-Z DLRM, 1 process, a busy loop pinned to CPU {busy_cpu}"),
        "ranks": ("The app's DLRM on 2 CPU processes under DMP against 1", "distributed_step",
                  f"ROBE-Z {args.compression:g}x DLRM, data-parallel, global batch "
                  f"{args.batch_size}, pipeline `{args.pipeline}`"),
        "full": (f"Training throughput: ROBE-Z {args.compression:g}x vs full tables (Hydra app)",
                 "train_throughput",
                 f"DLRM, 26 Criteo-like tables at scale {args.cardinality_scale}, dim {args.dim}, "
                 f"{args.nproc} process(es) x {args.threads} thread(s), batch {args.batch_size} "
                 f"per rank, pipeline `{args.pipeline}`, fused Adagrad on the embeddings")}[mode]
    lines = header(title, command_line("train_throughput", argv),
                   f"setup: {what}; {args.steps} steps a run; samples/s (all ranks) is the median "
                   f"of the {args.log_every}-step windows after the first; {args.rounds} round(s), "
                   f"settings alternating; 1-minute load {min(load):.1f}-{max(load):.1f}")
    lines += table(["run", "what the app logged", *(f"round {r}" for r in range(args.rounds)),
                    "median", f"/ {first}"],
                   [[n, logged[n], *(f"{x:,.0f}" for x in rates[n]), f"{med[n]:,.0f}",
                     f"{med[n] / med[first]:.2f}"] for n in runs]) + [""]
    if result["ratio"] is not None:
        lines.append(f"**ROBE-Z / full = {result['ratio']:.2f}x** (target >= {TARGET}x: "
                     f"**{'met' if result['ratio'] >= TARGET else 'missed'}**)")
    if result["cache_sized_ratio"] is not None:
        lines += ["", f"Full tables small enough to stay in cache / full = "
                  f"**{result['cache_sized_ratio']:.2f}x**: what the step gains when the tables' "
                  "memory traffic goes away (their lookups still cost something)."]
    publish(args.out, stem, lines, result)
    return result


if __name__ == "__main__":
    main()
