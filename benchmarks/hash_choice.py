"""Which hash should be the default? Measures both on quality and on speed, in one run.

Quality: the Quick start's DLRM (examples/quickstart_dlrm.py) trained on the synthetic data
with each hash, same seeds and steps, held-out AUC compared. Speed: the C++ forward and fused
backward at the benchmark shape (batch 32768, pair model, dim 64, Z = 32), both hashes timed
alternately in the same process.

Run::

    python -m benchmarks.hash_choice --out benchmarks/results/hash_choice.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch

from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops.meta import Optimizer, build_table_meta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_auc(hash_name: str, seed: int, steps: int, compression: float, block_size: int) -> float:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "quickstart_dlrm.py"), "--hash", hash_name,
           "--seed", str(seed), "--steps", str(steps), "--compression", str(compression),
           "--block-size", str(block_size), "--log-every", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1].split()[-1])


def time_kernels(memory_size: int, iters: int) -> Dict[str, Dict[str, float]]:
    batch, dim, z = 32768, 64, 32
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 1_562_500, (2 * batch,), generator=g)
    offsets = torch.arange(2 * batch + 1)
    meta = build_table_meta([dim, dim], [0, 0], [memory_size] * 2, [0, 0], [1_562_500] * 2, [0, 0])
    weights = torch.randn(memory_size, generator=g) * 0.01
    state = torch.zeros_like(weights)
    grad = torch.randn(batch, 2 * dim, generator=g)
    times: Dict[str, Dict[str, List[float]]] = {m.name.lower(): {"forward": [], "fused adagrad": []}
                                                for m in HashMode}
    for i in range(iters + 2):
        for mode in HashMode:
            params = hash_params(mode, 1024)
            t0 = time.perf_counter()
            torch.ops.robe.forward(weights, values, offsets, None, meta, 2 * dim, z, int(mode), params, 0)
            t1 = time.perf_counter()
            torch.ops.robe.backward_fused_(grad, weights, state, state.new_empty(0), values, offsets,
                                           None, meta, z, int(mode), params, int(Optimizer.ADAGRAD),
                                           [1e-3, 1e-10, 0.9, 0.999, 0.0], 1)
            t2 = time.perf_counter()
            if i >= 2:  # warm-up
                times[mode.name.lower()]["forward"].append((t1 - t0) * 1e3)
                times[mode.name.lower()]["fused adagrad"].append((t2 - t1) * 1e3)
    return {m: {k: statistics.median(v) for k, v in d.items()} for m, d in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--compressions", type=float, nargs="+", default=[100.0, 1000.0])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    lines = ["# Hash choice: reference vs mix", "",
             f"Command: `python -m benchmarks.hash_choice {' '.join(sys.argv[1:])}`  ",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
             "## Quality: held-out AUC of the Quick start DLRM (synthetic data)", "",
             "| compression | Z | seed | reference | mix | mix - reference |", "|---|---|---|---|---|---|"]
    deltas = []
    for compression in args.compressions:
        for seed in args.seeds:
            ref = train_auc("reference", seed, args.steps, compression, args.block_size)
            mix = train_auc("mix", seed, args.steps, compression, args.block_size)
            deltas.append(mix - ref)
            lines.append(f"| {compression:g}x | {args.block_size} | {seed} | {ref:.4f} | {mix:.4f} | {mix - ref:+.4f} |")
            print(lines[-1], flush=True)
    lines += ["", f"Mean AUC difference (mix - reference): {statistics.mean(deltas):+.4f} over "
              f"{len(deltas)} runs", "", "## Speed: C++ kernels, 1 thread, ms (median)", "",
              "| memory (floats) | op | reference | mix | mix / reference |", "|---|---|---|---|---|"]
    for memory in (262_144, 2_621_440):
        timing = time_kernels(memory, args.iters)
        for op in ("forward", "fused adagrad"):
            r, m = timing["reference"][op], timing["mix"][op]
            lines.append(f"| {memory:,} | {op} | {r:.2f} | {m:.2f} | {m / r:.2f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
