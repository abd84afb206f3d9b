"""CPU benchmark of the unpooled ROBE-Z lookup (``RobeEmbeddingCollection``) against its floors.

Setup: ``--batch`` samples with a history of ``--history`` item ids each (``n = batch *
history`` ids), one table of ``--rows`` rows x ``--dim``, compressed into a ROBE array of
``--memory`` floats, block size ``--block-size``, ids uniform. Rows (milliseconds, median over
``--iters`` interleaved rounds after ``--warmup``, one thread unless ``--threads``):

* ``forward floor``: writing the ``[n, dim]`` output from a cache-resident source
  (``index_select`` of a 256-row table by ``ids % 256``): no hashing, no array reads beyond
  cache;
* ``step floor``: the forward floor plus scattering the ``[n, dim]`` gradient into that
  cache-resident table (``index_add_``);
* ``unpooled, 1 feature``: ``RobeEmbeddingCollection`` forward, and a step (forward,
  ``backward`` with SGD fused into it);
* ``unpooled, 4 features (skewed)``: the same ids split over 4 features holding 55/25/15/5 %
  of them (the unit-bag padding writes ``4 * max n_f - n`` = 120 % extra zero rows);
* ``pooled, one id per bag``: ``RobeEmbeddingBagCollection`` on the same ids, one per bag:
  what the unpooled module computes, without its offsets and gather;
* ``stock EmbeddingCollection``: TorchRec's ``EmbeddingCollection`` with the full table
  (``--rows x --dim`` floats), dense gradient (its backward only; no optimizer step).

A step is forward, the sum of the output and ``backward()`` (the fused SGD update included).
A forward is the module call (its output kept only until the next row).

Every ratio in the results comes from the same run, rows interleaved round by round.

Run::

    python -m benchmarks.unpooled_ops                    # writes benchmarks/results/unpooled_ops.md
    python -m benchmarks.unpooled_ops --quick --out /tmp
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
from torchrec import (
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeEmbeddingCollection

SKEW = (0.55, 0.25, 0.15, 0.05)


def _kjt(keys: List[str], ids: torch.Tensor, counts: List[int], per_bag: int) -> KeyedJaggedTensor:
    """Feature-major ids, ``counts[f]`` of feature ``f``, in bags of ``per_bag`` ids."""
    bags = max(c // per_bag for c in counts)
    lengths = []
    for c in counts:
        n = torch.zeros(bags, dtype=torch.long)
        n[: c // per_bag] = per_bag
        lengths.append(n)
    return KeyedJaggedTensor.from_lengths_sync(keys, ids, torch.cat(lengths))


def build_rows(args) -> Dict[str, Callable[[], None]]:
    n = args.batch * args.history
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.rows, (n,), generator=g)
    robe = RobeConfig(memory_size=args.memory, block_size=args.block_size)

    def ec_of(keys):
        table = EmbeddingConfig(name="item_table", embedding_dim=args.dim, num_embeddings=args.rows,
                                feature_names=keys)
        module = RobeEmbeddingCollection([table], robe)
        apply_optimizer_in_backward(torch.optim.SGD, [module.weight], {"lr": 0.01})
        return module

    one = ec_of(["history"])
    one_kjt = _kjt(["history"], ids, [n], args.history)
    keys4 = [f"h{i}" for i in range(4)]
    counts4 = [int(n * s) // args.history * args.history for s in SKEW]
    ids4 = ids[: sum(counts4)]
    four = ec_of(keys4)
    four_kjt = _kjt(keys4, ids4, counts4, args.history)
    bag = RobeEmbeddingBagCollection(
        [EmbeddingBagConfig(name="item_table", embedding_dim=args.dim, num_embeddings=args.rows,
                            feature_names=["history"])], robe)
    apply_optimizer_in_backward(torch.optim.SGD, [bag.weight], {"lr": 0.01})
    bag_kjt = _kjt(["history"], ids, [n], 1)
    stock = EmbeddingCollection([EmbeddingConfig(name="item_table", embedding_dim=args.dim,
                                                 num_embeddings=args.rows,
                                                 feature_names=["history"])])
    source = torch.randn(256, args.dim)
    small_ids = ids % 256
    out_buffer = torch.empty(n, args.dim)
    grad = torch.randn(n, args.dim)

    def forward_floor():
        torch.index_select(source, 0, small_ids, out=out_buffer)

    def step_floor():
        torch.index_select(source, 0, small_ids, out=out_buffer)
        source.index_add_(0, small_ids, grad, alpha=0.0)

    def unpooled_sum(module, kjt):
        # per feature: no copy into one tensor, which would time the benchmark's own cat
        return sum(jt.values().sum() for jt in module(kjt).values())

    def step(fn):
        def run():
            fn().backward()
        return run

    return {
        "forward floor": forward_floor,
        "step floor": step_floor,
        "unpooled, 1 feature: forward": lambda: one(one_kjt),
        "unpooled, 1 feature: step": step(lambda: unpooled_sum(one, one_kjt)),
        "unpooled, 4 features (skewed): forward": lambda: four(four_kjt),
        "unpooled, 4 features (skewed): step": step(lambda: unpooled_sum(four, four_kjt)),
        "pooled, one id per bag: forward": lambda: bag(bag_kjt),
        "pooled, one id per bag: step": step(lambda: bag(bag_kjt).values().sum()),
        "stock EmbeddingCollection: forward": lambda: stock(one_kjt),
        "stock EmbeddingCollection: step": step(lambda: stock(one_kjt)["history"].values().sum()),
    }


def measure(rows: Dict[str, Callable[[], None]], warmup: int, iters: int) -> Dict[str, float]:
    for _ in range(warmup):
        for fn in rows.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in rows}
    for _ in range(iters):  # round-robin: drifts of the machine hit every row alike
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def report(args, ms: Dict[str, float]) -> str:
    n = args.batch * args.history
    lines = [
        "# Unpooled ROBE-Z lookup on CPU (`RobeEmbeddingCollection`)",
        "",
        f"Command: `{' '.join(shlex.quote(a) for a in [sys.executable.split('/')[-1], '-m', 'benchmarks.unpooled_ops', *sys.argv[1:]])}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} logical CPUs, torch "
        f"{torch.__version__}, {args.threads} thread(s); "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"{n:,} ids ({args.batch} x {args.history}), dim {args.dim}, table {args.rows:,} rows, "
        f"ROBE array {args.memory:,} floats, Z = {args.block_size}; median of {args.iters} "
        f"interleaved rounds (ms). Floors: see `benchmarks/unpooled_ops.py`.",
        "",
        "| row | ms | x forward floor | x step floor |",
        "| --- | --- | --- | --- |",
    ]
    ff, sf = ms["forward floor"], ms["step floor"]
    for name, t in ms.items():
        lines.append(f"| {name} | {t:.2f} | {t / ff:.1f}x | {t / sf:.1f}x |")
    fwd1 = ms["unpooled, 1 feature: forward"]
    lines += [
        "",
        f"Unpooled (1 feature) over pooled with one id per bag, forward: "
        f"{fwd1 / ms['pooled, one id per bag: forward']:.2f}x; step: "
        f"{ms['unpooled, 1 feature: step'] / ms['pooled, one id per bag: step']:.2f}x.",
        f"4 skewed features over 1 feature, forward: "
        f"{ms['unpooled, 4 features (skewed): forward'] / fwd1:.2f}x (padding and gather).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--history", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--memory", type=int, default=2_621_440)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.history, args.rows, args.memory = 16, 4, 1000, 4096
        args.dim, args.warmup, args.iters = 8, 1, 2
    torch.set_num_threads(args.threads)
    ms = measure(build_rows(args), args.warmup, args.iters)
    text = report(args, ms)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "unpooled_ops.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "unpooled_ops.json"), "w") as f:
        json.dump({"args": vars(args), "ms": ms}, f, indent=1)


if __name__ == "__main__":
    main()
