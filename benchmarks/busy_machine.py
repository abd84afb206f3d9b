"""The training app's thread default on a busy machine: samples/s of the same short run while
a background busy loop holds one core, with the default thread count
(:func:`robe_torchrec.threads.choose_threads`), with ``run.threads=1``, and with torch's own
default (what the app used before it chose: one thread per physical core).

Each run is ``python -m robe_torchrec.train`` (ROBE-Z DLRM, synthetic data pre-generated with
``data.cycle``) in its own run directory; its samples/s is the median of its log windows after
the first, from ``metrics.csv``. The busy loop is a Python ``while True`` pinned to the last
CPU this process may use; runs alternate over ``--rounds`` rounds so load changes hit every
setting alike (each round starts with the next setting: the first run after the busy loop
starts was the slowest). The app's own log line says what it chose and why.

Usage::

    python -m benchmarks.busy_machine --out benchmarks/results/busy_machine.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from benchmarks.train_throughput import log_line, run_app
from robe_torchrec.pipelines.report import machine, machine_line, write_report

BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def _command(args: argparse.Namespace, threads: Optional[int], run_dir: Path) -> List[str]:
    return [sys.executable, "-m", "robe_torchrec.train", "embedding=robe",
            f"run.steps={args.steps}", f"run.batch_size={args.batch_size}",
            f"run.log_every={args.log_every}", "run.eval_batches=0", "run.test_batches=0",
            "run.progress_bar=false", f"data.cycle={args.cycle}", f"hydra.run.dir={run_dir}",
            f"run.threads={'null' if threads is None else threads}"]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.busy_machine",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--cycle", type=int, default=4, help="pre-generated batches")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    torch_default = torch.get_num_threads()  # nothing set yet in this process
    settings: Dict[str, Optional[int]] = {"default (chosen)": None, "run.threads=1": 1,
                                          f"torch's default ({torch_default})": torch_default}
    rates: Dict[str, List[float]] = {name: [] for name in settings}
    chosen: Dict[str, str] = {}
    busy_cpu = max(os.sched_getaffinity(0))
    load = [os.getloadavg()[0]]
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(busy_cpu)])
    try:
        time.sleep(1.0)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                names = list(settings)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    threads = settings[name]
                    run_dir = Path(tmp) / f"{r}_{threads}"
                    start = time.perf_counter()
                    rates[name].append(run_app(_command(args, threads, run_dir), run_dir))
                    chosen[name] = log_line(run_dir, "threads: ").removeprefix("threads: ")
                    load.append(os.getloadavg()[0])
                    print(f"round {r} {name:22s} {rates[name][-1]:9,.0f} samples/s "
                          f"(run {time.perf_counter() - start:.0f} s): {chosen[name]}",
                          flush=True)
    finally:
        busy.kill()
        busy.wait()
    med = {name: statistics.median(v) for name, v in rates.items()}
    one = med["run.threads=1"]
    report = [
        "# Thread default on a busy machine (training app)", "",
        f"Command: `python -m benchmarks.busy_machine {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        f"Machine: {machine_line()}; {len(os.sched_getaffinity(0))} usable CPU(s); a busy loop "
        f"pinned to CPU {busy_cpu} for the whole measurement; 1-minute load average "
        f"{min(load):.1f}-{max(load):.1f} during the runs (it includes the busy loop and any "
        "other process on the machine).", "",
        f"Setup: ROBE-Z DLRM on synthetic Criteo-like data, 1 process, batch {args.batch_size}, "
        f"{args.steps} steps; samples/s is the median of the {args.log_every}-step windows "
        f"after the first; {args.rounds} round(s), settings alternating, each round starting "
        "with the next setting.", "",
        "| threads | what the app logged | samples/s (per round) | median | / run.threads=1 |",
        "|---|---|---|---:|---:|",
    ]
    for name in settings:
        report.append(f"| {name} | {chosen[name]} | "
                      + ", ".join(f"{x:,.0f}" for x in rates[name])
                      + f" | {med[name]:,.0f} | {med[name] / one:.2f} |")
    if chosen["default (chosen)"].startswith("1 thread(s)"):
        report += ["", "The default chose 1 thread here, as `run.threads=1` does, and runs "
                   "the same code from then on; compare the gap between those two rows with "
                   "each row's spread across rounds: this short measurement on a loaded "
                   "machine does not separate them. The collapse is torch's default's."]
    text = "\n".join(report) + "\n"
    print(text)
    if args.out is not None:
        result = {"machine": machine(), "samples_per_s": rates, "median": med,
                  "chosen": chosen, "load_average": load, "busy_cpu": busy_cpu}
        write_report(args.out.parent, args.out.stem, result, text)


if __name__ == "__main__":
    main()
