"""DLRM dot interaction: TorchRec's ``InteractionArch`` against ``FastInteractionArch``,
forward + backward, side by side in one process (the two alternate within every round).

Usage::

    python -m benchmarks.interaction --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch
from torchrec.models.dlrm import InteractionArch

from robe_torchrec.pipelines.report import machine, machine_line, write_report
from robe_torchrec.interaction import FastInteractionArch


def _step_ms(arch: torch.nn.Module, dense: torch.Tensor, sparse: torch.Tensor,
             upstream: torch.Tensor) -> float:
    start = time.perf_counter()
    out = arch(dense, sparse)
    torch.autograd.grad(out, (dense, sparse), upstream)
    return (time.perf_counter() - start) * 1e3


def measure(batch: int, features: int, dim: int, rounds: int, iters: int) -> Dict[str, float]:
    """Median forward + backward ms of both archs; they alternate every iteration."""
    archs = {"torchrec": InteractionArch(features), "fast": FastInteractionArch(features)}
    dense = torch.randn(batch, dim, requires_grad=True)
    sparse = torch.randn(batch, features, dim, requires_grad=True)
    upstream = torch.randn(batch, dim + features * (features + 1) // 2)
    times: Dict[str, List[float]] = {name: [] for name in archs}
    for name, arch in archs.items():  # warm-up
        _step_ms(arch, dense, sparse, upstream)
    for _ in range(rounds * iters):
        for name, arch in archs.items():
            times[name].append(_step_ms(arch, dense, sparse, upstream))
    result = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    result["speedup"] = result["torchrec_ms"] / result["fast_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["2048x26x16", "2048x26x128", "512x26x16"],
                        help="batch x sparse features x dim")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = []
    for shape in args.shapes:
        batch, features, dim = (int(v) for v in shape.split("x"))
        rows.append({"batch": batch, "features": features, "dim": dim,
                     **measure(batch, features, dim, args.rounds, args.iters)})
    load = os.getloadavg()[0]
    lines = ["# DLRM dot interaction: TorchRec's InteractionArch vs FastInteractionArch", "",
             f"Command: `python -m benchmarks.interaction "
             f"{' '.join(sys.argv[1:])}`", "",
             f"Machine: {machine_line()}; {args.threads} thread(s); load average (1 min) "
             f"at the end {load:.2f}. Forward + backward (random upstream gradient), median of "
             f"{args.rounds * args.iters} alternating iterations, ms.", "",
             "| batch | sparse features | dim | TorchRec | Fast | speedup |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['features']} | {r['dim']} | {r['torchrec_ms']:.2f} | "
              f"{r['fast_ms']:.2f} | {r['speedup']:.2f}x |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_report(args.out, "interaction", {"machine": machine(), "args": vars(args),
                                               "rows": rows, "load_average": load}, text)


if __name__ == "__main__":
    main()
