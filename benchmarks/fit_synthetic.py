"""Fits the realistic synthetic mode's id-popularity law on the real Criteo rows.

For each of the 26 categorical features of the 10,000 real rows (empty fields are an id of
their own, as the loaders read them: id 0) it fits a truncated power law
``P(rank r) ~ r ** -s`` over ``N`` ids:

* the exponent ``s``: a least-squares line through ``log(count)`` against ``log(rank)`` over
  the ranks seen at least 3 times (rank-frequency regression; ids seen once or twice are too
  noisy to place on the line);
* the cardinality ``N``: the number of ids whose expected number of distinct ids in 10,000
  draws of that law equals the distinct ids seen (bisection on ``log N``), capped at the
  feature's full Kaggle cardinality (a feature whose ids are all seen many times gets the
  distinct count itself).

Prints the values and writes them to ``<out>/synthetic_fit.json``; the realistic mode's
constants in ``robe_torchrec/data/synthetic.py`` are these values. Also plots
``<out>/synthetic_vs_real.png``: the id-frequency curves and the click rates of each
feature's most frequent ids, for the real rows and for as many rows of the realistic mode
(``cardinality_scale=0.01``), side by side on the same axes.

Usage::

    python -m benchmarks.fit_synthetic --out benchmarks/results
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from typing import Dict, List

import numpy as np

from robe_torchrec.data.synthetic import CRITEO_KAGGLE_CARDINALITIES

REAL_ROWS = "/work/shared/data/criteo_kaggle_head10k.tsv"
MIN_COUNT = 3


def read_rows(path: str):
    """(labels [n], categorical columns: 26 lists of strings) of a raw Criteo TSV."""
    labels, cats = [], [[] for _ in range(26)]
    with open(path) as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            labels.append(int(fields[0]))
            for j, value in enumerate(fields[14:40]):
                cats[j].append(value)
    return np.array(labels), cats


def expected_distinct(n_ids: float, s: float, draws: int) -> float:
    ranks = np.arange(1, int(n_ids) + 1, dtype=np.float64)
    p = ranks ** -s
    p /= p.sum()
    return float(np.sum(-np.expm1(draws * np.log1p(-p))))


def fit_feature(values: List[str], cap: int) -> Dict[str, float]:
    counts = np.array(sorted(collections.Counter(values).values(), reverse=True), np.float64)
    distinct, draws = len(counts), len(values)
    head = counts[counts >= MIN_COUNT]
    if len(head) >= 3:
        slope = np.polyfit(np.log(np.arange(1, len(head) + 1)), np.log(head), 1)[0]
        s = float(max(0.0, -slope))
    else:
        s = 0.0
    lo, hi = float(distinct), float(cap)
    if hi <= lo or expected_distinct(lo, s, draws) >= distinct - 0.5:
        n_ids = distinct
    elif expected_distinct(hi, s, draws) <= distinct:
        n_ids = cap
    else:
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if expected_distinct(mid, s, draws) < distinct else (lo, mid)
        n_ids = int(round(hi))
    return {"exponent": round(s, 3), "cardinality": int(n_ids), "distinct": distinct,
            "top_share": float(counts[0] / draws)}


def _synthetic_rows(count: int):
    import torch

    from robe_torchrec.data.synthetic import SyntheticCriteo

    data = SyntheticCriteo(batch_size=count, cardinality_scale=0.01, seed=0, mode="realistic")
    batch = data.batch(0)
    ids = batch.sparse_features.values().view(len(data.keys), -1)
    return batch.labels.to(torch.int64).numpy(), [row.tolist() for row in ids]


def _per_feature(labels: np.ndarray, column: List) -> tuple:
    """(frequency share by rank, click rates of the ids seen at least 50 times, their shares)"""
    by_id = collections.defaultdict(list)
    for value, label in zip(column, labels):
        by_id[value].append(label)
    groups = sorted(by_id.values(), key=len, reverse=True)
    shares = np.array([len(g) for g in groups]) / len(labels)
    frequent = [g for g in groups if len(g) >= 50][:10]
    return shares, [float(np.mean(g)) for g in frequent], [len(g) / len(labels) for g in frequent]


def plot(real, synthetic, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="row", sharey="row")
    for col, (name, (labels, cats)) in enumerate((("real Criteo rows", real),
                                                   ("realistic synthetic", synthetic))):
        freq, rate = axes[0, col], axes[1, col]
        cmap = plt.get_cmap("viridis")
        for j, column in enumerate(cats):
            shares, rates, rate_shares = _per_feature(labels, column)
            color = cmap(j / (len(cats) - 1))
            freq.plot(np.arange(1, len(shares) + 1), shares, color=color, linewidth=0.9)
            rate.scatter([j] * len(rates), rates, s=[400 * s for s in rate_shares],
                         color=color, alpha=0.7)
        freq.set_xscale("log")
        freq.set_yscale("log")
        freq.set_xlabel("id rank (by frequency)")
        freq.set_ylabel("share of rows")
        freq.set_title(f"{name}: id frequency\n26 features, {len(labels):,} rows", fontsize=10)
        rate.axhline(labels.mean(), color="black", linewidth=0.8,
                     label=f"click rate {labels.mean():.3f}")
        rate.set_xlabel("feature")
        rate.set_ylabel("click rate of the id's rows")
        rate.set_title(f"{name}: click rate of each feature's 10 most frequent ids\n"
                       "(>= 50 rows; area ~ frequency)", fontsize=9)
        rate.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=REAL_ROWS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    labels, cats = read_rows(args.rows)
    fits = [fit_feature(values, cap) for values, cap in zip(cats, CRITEO_KAGGLE_CARDINALITIES)]
    print(f"{len(labels)} rows, click rate {labels.mean():.4f}")
    print("feature  distinct  exponent  cardinality  (Kaggle)  top id share")
    for j, (fit, cap) in enumerate(zip(fits, CRITEO_KAGGLE_CARDINALITIES)):
        print(f"cat_{j:<4} {fit['distinct']:>8}  {fit['exponent']:>8.3f}  {fit['cardinality']:>11}"
              f"  {cap:>9}  {fit['top_share']:.3f}")
    print("exponents =", [f["exponent"] for f in fits])
    print("cardinalities =", [f["cardinality"] for f in fits])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "synthetic_fit.json"), "w") as f:
            json.dump({"command": "python -m benchmarks.fit_synthetic " +
                       (f"--out {args.out}" if args.out else ""), "rows": args.rows,
                       "click_rate": float(labels.mean()), "min_count": MIN_COUNT,
                       "features": fits}, f, indent=1)
        plot((labels, cats), _synthetic_rows(len(labels)),
             os.path.join(args.out, "synthetic_vs_real.png"))


if __name__ == "__main__":
    main()
