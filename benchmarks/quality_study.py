"""Quality study: test AUC of the ROBE-Z DLRM against compression, block size Z and hash mode,
next to the full-table DLRM on the same data, steps and seed; several seeds per cell (mean and
spread), for one or more embedding dims, on the synthetic Criteo-like data (``--mode
realistic`` by default: the mode fitted on real Criteo rows; ``hard`` is the older stream).

A compression ratio is relative to the full tables of the same dim, so the same ratio leaves
8x more floats at dim 128 than at dim 16: the study runs both and plots the AUC gap against
the stored floats as well.

Every row trains the app's DLRM (``robe_torchrec.dlrm``, the app's layer sizes, Adagrad at
the app's learning rates, the embedding optimizer fused into backward) in this process, one
thread, without DMP. For each seed the training and test batches are generated once and
every row of that seed trains on them; the full-table run of a (seed, dim) is the baseline
of every ROBE-Z cell of that seed and dim. A seed sets the data (hidden model and stream),
the dense initialisation and the hash seed (``1024 + seed``). Two reference rows need no
training: the hidden model that drew the labels (the best AUC any model can reach) and its
dense part alone.

Writes ``<name>.{md,json,png}`` (``--name``, default ``quality_study_<mode>``).

Usage::

    python -m benchmarks.quality_study --name quality_study_realistic --out benchmarks/results
    python -m benchmarks.quality_study --steps 20 --dims 16 --compressions 100 \\
        --block-sizes 8 --hashes reference --seeds 0 --out /tmp/q      # a quick check
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Dict, List

import torch
from torchmetrics.functional.classification import binary_auroc

from benchmarks.train_loop import (CELL, build, group_by, mean_and_spread, quality_spec, score,
                                   train, with_gaps)
from robe_torchrec.pipelines.report import machine, machine_line, write_report
from robe_torchrec.config import RobeConfig
from robe_torchrec.data.synthetic import SyntheticCriteo

# where the training app's test stream starts (robe_torchrec.train.data)
from robe_torchrec.train.data import TEST_STREAM_START

#: the targets: the largest AUC loss against the full tables at a compression (seed means)
TARGET_GAPS: Dict[float, float] = {100.0: 0.002, 1000.0: 0.005}


def _oracle_aucs(data: SyntheticCriteo, batches) -> Dict[str, float]:
    labels = torch.cat([b.labels for b in batches]).long()
    return {name: binary_auroc(torch.cat([data.hidden_logit(b, sparse) for b in batches]),
                               labels).item()
            for name, sparse in (("hidden model (all features)", True),
                                 ("hidden model, dense features only", False))}


def _cells(args) -> List[Dict]:
    return [{"block_size": z, "hash": h, "compression": float(c)}
            for h, z, c in itertools.product(args.hashes, args.block_sizes, args.compressions)]


def _run_seed(args, seed: int) -> Dict:
    """Every row of one seed, on batches generated once."""
    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                           seed=seed, mode=args.mode)
    train_batches = [data.batch(i) for i in range(args.steps)]
    test_batches = [data.batch(TEST_STREAM_START + i) for i in range(args.test_batches)]
    rows = []
    for dim in args.dims:
        for cell in [None] + _cells(args):
            robe = None if cell is None else RobeConfig(
                compression=cell["compression"], block_size=cell["block_size"],
                hash=cell["hash"], seed=1024 + seed)
            t0 = time.perf_counter()
            spec = quality_spec(dim, robe)
            model = build(spec, data.keys, data.cardinalities, seed)
            train(model, spec, train_batches)
            auc, log_loss = score(model, test_batches)
            floats = sum(p.numel() for p in model.sparse_arch.embedding_bag_collection.parameters())
            row = {"seed": seed, "dim": dim, "embedding": "full" if cell is None else "robe",
                   "block_size": None, "hash": None, "compression": 1.0, **(cell or {}),
                   "test_auc": auc, "test_log_loss": log_loss, "stored_floats": floats,
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"seed {seed} dim {dim} {row['embedding']} Z={row['block_size']} {row['hash']} "
                  f"{row['compression']:,.0f}x: test AUC {auc:.4f} ({row['seconds']:.1f} s)",
                  flush=True)
    return {"rows": with_gaps(rows, {"embedding": "full"}, ["dim"]), "oracle": _oracle_aucs(data, test_batches)}


def _summary(rows: List[Dict]) -> List[Dict]:
    """One entry per (dim, embedding, Z, hash, compression): the mean and spread over seeds."""
    out = []
    for (dim, emb, z, h, c), rs in group_by(rows, CELL).items():
        gap, gap_sd, gap_se = mean_and_spread([r["auc_gap"] for r in rs])
        out.append({"dim": dim, "embedding": emb, "block_size": z, "hash": h, "compression": c,
                    "stored_floats": rs[0]["stored_floats"], "seeds": [r["seed"] for r in rs],
                    "test_auc": mean_and_spread([r["test_auc"] for r in rs])[0],
                    "auc_gap": gap, "auc_gap_sd": gap_sd, "auc_gap_se": gap_se,
                    "auc_gaps": [r["auc_gap"] for r in rs]})
    return out


def target_lines(summary: List[Dict], dim: int) -> List[str]:
    """The targets judged on the seed means of every ROBE-Z setting at ``dim``."""
    lines = []
    for c, target in TARGET_GAPS.items():
        cells = [s for s in summary if s["embedding"] == "robe" and s["dim"] == dim
                 and s["compression"] == c]
        if not cells:
            continue
        met = [s for s in cells if s["auc_gap"] >= -target]
        verdict = "met" if len(met) == len(cells) else (
            f"met by {len(met)} of {len(cells)} settings" if met else "missed")
        lo, hi = min(s["auc_gap"] for s in cells), max(s["auc_gap"] for s in cells)
        lines.append(f"- {c:,.0f}x within {target} AUC of the full tables (seed means): "
                     f"**{verdict}** (mean AUC - full from {lo:+.4f} to {hi:+.4f} over "
                     f"{len(cells)} Z/hash setting(s))")
    return lines


def _plot(result: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, a = result["summary"], result["args"]
    robe = [s for s in summary if s["embedding"] == "robe"]
    fig, (by_ratio, by_memory) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for dim, color in zip(a["dims"], ("tab:blue", "tab:orange", "tab:green", "tab:purple")):
        for (h, z), marker in zip(itertools.product(a["hashes"], a["block_sizes"]), "osd^v<>"):
            pts = sorted((s["compression"], s["stored_floats"], s["auc_gap"], s["auc_gap_sd"])
                         for s in robe if s["dim"] == dim and s["hash"] == h
                         and s["block_size"] == z)
            style = dict(marker=marker, color=color, capsize=2, alpha=0.8,
                         linestyle="-" if h == "reference" else "--")
            by_ratio.errorbar([p[0] for p in pts], [p[2] for p in pts], [p[3] for p in pts],
                              label=f"dim {dim}, Z={z}, {h} hash", **style)
            by_memory.errorbar([p[1] for p in pts], [p[2] for p in pts], [p[3] for p in pts],
                               **style)
    for ax in (by_ratio, by_memory):
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        for c, gap in TARGET_GAPS.items():
            ax.axhline(-gap, color="tab:red", linestyle=":", linewidth=0.8)
            ax.annotate(f"target at {c:,.0f}x: -{gap}", (1, -gap), fontsize=7,
                        xycoords=("axes fraction", "data"), ha="right", va="bottom")
    by_ratio.set_xlabel("compression (uncompressed / stored floats)")
    by_ratio.set_ylabel("test AUC - full tables of the same dim (mean +- sd over seeds)")
    by_ratio.legend(fontsize=7, loc="lower left")
    by_memory.set_xlabel("stored floats of the ROBE-Z array")
    by_memory.set_title("the same points against the stored floats")
    fig.suptitle(f"DLRM on {a['mode']} synthetic data, {a['steps']} steps of {a['batch_size']}, "
                 f"seeds {a['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _markdown(result: Dict) -> str:
    a = result["args"]
    lines = [
        f"# Quality study: AUC against compression, Z and hash ({a['mode']} synthetic data)", "",
        f"`{result['command']}`", "",
        f"Machine: {machine_line(result['machine'])}. The app's DLRM (Adagrad, embeddings fused "
        f"into backward), trained in one process on 1 thread, {a['steps']} steps of batch "
        f"{a['batch_size']}, {a['mode']} synthetic data at cardinality scale "
        f"{a['cardinality_scale']}; test AUC over {a['test_batches'] * a['batch_size']:,} "
        f"held-out samples. Seeds {a['seeds']}: each sets the data, the dense initialisation "
        f"and the hash seed; every gap is against the full tables of the same seed and dim, "
        f"then averaged over the seeds (sd: their standard deviation). Total "
        f"{result['seconds'] / 60:.1f} min.",
    ]
    for dim in a["dims"]:
        cells = [s for s in result["summary"] if s["dim"] == dim]
        full = [s for s in cells if s["embedding"] == "full"][0]
        lines += [
            "", f"## Embedding dim {dim} (full tables: {full['stored_floats']:,} floats, mean "
                f"test AUC {full['test_auc']:.4f})", "",
            "| embeddings | Z | hash | compression | stored floats | mean test AUC | "
            "AUC - full, mean | sd | per seed |",
            "|---|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for s in cells:
            if s["embedding"] == "full":
                continue
            lines.append(
                f"| robe | {s['block_size']} | {s['hash']} | {s['compression']:,.0f}x | "
                f"{s['stored_floats']:,} | {s['test_auc']:.4f} | {s['auc_gap']:+.4f} | "
                f"{s['auc_gap_sd']:.4f} | {', '.join(f'{g:+.4f}' for g in s['auc_gaps'])} |")
        lines += [""] + target_lines(result["summary"], dim)
    lines += ["", "## References (no training, mean over seeds)", "",
              "| reference | test AUC |", "|---|---:|"]
    for name in result["oracle"][0]:
        lines.append(f"| {name} | "
                     f"{mean_and_spread([o[name] for o in result['oracle']])[0]:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("realistic", "hard"), default="realistic")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    parser.add_argument("--test-batches", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--compressions", type=float, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--hashes", nargs="+", default=["reference", "mix"])
    parser.add_argument("--name", default=None,
                        help="stem of the result files (default: quality_study_<mode>)")
    parser.add_argument("--out", default=None, help="folder for <name>.{md,json,png}")
    args = parser.parse_args()
    args.name = args.name or f"quality_study_{args.mode}"
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    runs = [_run_seed(args, seed) for seed in args.seeds]
    rows = [r for run in runs for r in run["rows"]]
    result = {"command": "python -m benchmarks.quality_study " + " ".join(sys.argv[1:]),
              "machine": machine(), "args": vars(args), "rows": rows,
              "summary": _summary(rows), "oracle": [run["oracle"] for run in runs],
              "seconds": time.perf_counter() - t0}
    text = _markdown(result)
    print(text)
    if args.out:
        write_report(args.out, args.name, result, text)
        _plot(result, os.path.join(args.out, f"{args.name}.png"))


if __name__ == "__main__":
    main()
