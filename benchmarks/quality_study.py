"""How much test AUC does ROBE-Z cost against full tables, by compression, Z, hash and dim?
On synthetic Criteo-like data (several seeds) or on the 10,000 real rows (``--data real``:
random 80/20 splits).

Every row trains the app's DLRM in this process on one thread (:mod:`benchmarks.train_loop`).
A replicate (seed or split) makes its batches once; its full tables of a dim are the baseline
of its ROBE-Z cells of that dim; gaps are averaged over replicates. A seed sets the data, the
dense initialisation and the hash seed; the synthetic study also scores the hidden model that
drew the labels and plots the gaps. 10,000 real rows check real ids and labels; they do not
show the cost at the 45M rows' scale. Writes ``<name>.{md,json}`` (and ``.png``)::

    python -m benchmarks.quality_study --name quality_study_realistic --out benchmarks/results
    python -m benchmarks.quality_study --data real --out benchmarks/results
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.common import command_line, header, parser, publish, table
from benchmarks.train_loop import (CELL, build, group_by, mean_and_spread, quality_spec, score,
                                   train, with_gaps)
from robe_torchrec.config import RobeConfig

REAL_ROWS = "/work/shared/data/criteo_kaggle_head10k.tsv"
#: the targets: the largest AUC loss against the full tables at a compression (means)
TARGET_GAPS: Dict[float, float] = {100.0: 0.002, 1000.0: 0.005}
#: option -> (synthetic default, real default)
DEFAULTS = {"replicates": ([0, 1, 2], 5), "steps": (200, None), "batch_size": (512, 256),
            "hashes": (["reference", "mix"], ["reference"])}


def synthetic_replicates(args):
    """Per seed: (seed, train batches, test batches, keys, cardinalities, reference AUCs)."""
    from torchmetrics.functional.classification import binary_auroc

    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.train.data import TEST_STREAM_START  # where the app's test stream starts

    for seed in args.replicates:
        data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                               seed=seed, mode=args.mode)
        test = [data.batch(TEST_STREAM_START + i) for i in range(args.test_batches)]
        labels = torch.cat([b.labels for b in test]).long()
        oracle = {name: binary_auroc(torch.cat([data.hidden_logit(b, sparse) for b in test]),
                                     labels).item()
                  for name, sparse in (("hidden model (all features)", True),
                                       ("hidden model, dense features only", False))}
        train_batches = [data.batch(i) for i in range(args.steps)]
        yield seed, train_batches, test, data.keys, data.cardinalities, oracle


def real_replicates(args):
    """Per split: (split, train batches, test batches, keys, cardinalities, {})."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from robe_torchrec.data import CriteoTsv

    batch = next(iter(CriteoTsv([args.rows], batch_size=10**7, num_embeddings_per_feature=None)))
    kjt, keys = batch.sparse_features, batch.sparse_features.keys()
    uniques = [torch.unique(kjt[k].values(), return_inverse=True) for k in keys]
    ids = torch.stack([inverse for _, inverse in uniques])
    cards = [int(unique.numel()) for unique, _ in uniques]
    args.rows_read, args.click_rate = int(batch.labels.numel()), float(batch.labels.mean())

    def batches_of(rows: torch.Tensor) -> List[Batch]:
        ones = torch.ones(len(keys) * args.batch_size, dtype=torch.int32)
        return [Batch(dense_features=batch.dense_features[r], labels=batch.labels[r],
                      sparse_features=KeyedJaggedTensor(keys=keys, values=ids[:, r].reshape(-1),
                                                        lengths=ones[:len(keys) * r.numel()]))
                for r in rows.split(args.batch_size)]

    for split in range(args.replicates):
        g = torch.Generator().manual_seed(split)
        perm = torch.randperm(args.rows_read, generator=g)
        cut = int(args.rows_read * (1 - args.test_fraction))
        train_batches = [b for _ in range(args.epochs)
                         for b in batches_of(perm[:cut][torch.randperm(cut, generator=g)])]
        yield split, train_batches, batches_of(perm[cut:]), keys, cards, {}


def train_cells(args, key: str, replicate: int, train_batches, test, keys, cards) -> List[Dict]:
    """The full tables and every ROBE-Z cell, at every dim, on one replicate's batches."""
    rows = []
    for dim in args.dims:
        for h, z, c in [(None, None, 1.0)] + list(itertools.product(args.hashes, args.block_sizes,
                                                                    args.compressions)):
            robe = None if z is None else RobeConfig(compression=c, block_size=z, hash=h,
                                                     seed=1024 + replicate)
            t0 = time.perf_counter()
            spec = quality_spec(dim, robe)
            model = build(spec, keys, cards, replicate)
            train(model, spec, train_batches)
            auc, log_loss = score(model, test)
            ebc = model.sparse_arch.embedding_bag_collection
            rows.append({key: replicate, "dim": dim, "embedding": "full" if z is None else "robe",
                         "block_size": z, "hash": h, "compression": float(c), "test_auc": auc,
                         "test_log_loss": log_loss, "seconds": time.perf_counter() - t0,
                         "stored_floats": sum(p.numel() for p in ebc.parameters())})
            print(f"{key} {replicate} dim {dim} Z={z} {h} {c:,.0f}x: AUC {auc:.4f}", flush=True)
    return with_gaps(rows)


def summary(rows: List[Dict], key: str) -> List[Dict]:
    """One entry per (dim, embedding, Z, hash, compression): the mean and spread over the
    replicates of its AUC and of its gap to the full tables."""
    out = []
    for (dim, emb, z, h, c), rs in group_by(rows, CELL).items():
        auc, _, auc_se = mean_and_spread([r["test_auc"] for r in rs])
        gap, sd, se = mean_and_spread([r["auc_gap"] for r in rs])
        out.append({"dim": dim, "embedding": emb, "block_size": z, "hash": h, "compression": c,
                    "stored_floats": rs[0]["stored_floats"], f"{key}s": [r[key] for r in rs],
                    "test_auc": auc, "test_auc_se": auc_se, "auc_gap": gap, "auc_gap_sd": sd,
                    "auc_gap_se": se, "auc_gaps": [r["auc_gap"] for r in rs]})
    return out


def target_lines(cells: List[Dict]) -> List[str]:
    """The targets judged on the means of every ROBE-Z setting of one dim."""
    lines = []
    for c, target in TARGET_GAPS.items():
        at = [s for s in cells if s["embedding"] == "robe" and s["compression"] == c]
        met = [s for s in at if s["auc_gap"] >= -target]
        if at:
            verdict = ("met" if len(met) == len(at) else
                       f"met by {len(met)} of {len(at)} settings" if met else "missed")
            gaps = [s["auc_gap"] for s in at]
            lines.append(f"- {c:,.0f}x within {target} AUC of the full tables (means): "
                         f"**{verdict}** (mean AUC - full from {min(gaps):+.4f} to "
                         f"{max(gaps):+.4f} over {len(at)} Z/hash setting(s))")
    return lines


def markdown(result: Dict, argv: Optional[Sequence[str]]) -> List[str]:
    a, key = result["args"], result["replicate"]
    data = "real rows" if key == "split" else f"{a['mode']} synthetic data"
    setup = (f"cardinality scale {a['cardinality_scale']}, {a['steps']} steps of batch "
             f"{a['batch_size']}, seeds {a['replicates']}" if key == "seed" else
             f"{a['rows_read']:,} rows (click rate {a['click_rate']:.3f}), {a['replicates']} "
             f"splits ({a['test_fraction']:.0%} test), {a['epochs']} epochs of batch "
             f"{a['batch_size']}")
    lines = header(f"Quality study: AUC against compression, Z and hash ({data})",
                   command_line("quality_study", argv),
                   f"setup: the app's DLRM (Adagrad, embeddings fused into backward), 1 thread, "
                   f"{data}, {setup}; every gap is against the full tables of the same {key} and "
                   f"dim, then mean, sd and se over the {key}s; {result['seconds'] / 60:.1f} min")
    for dim in a["dims"]:
        cells = [s for s in result["summary"] if s["dim"] == dim]
        full = next(s for s in cells if s["embedding"] == "full")
        rows = [["robe", s["block_size"], s["hash"], f"{s['compression']:,.0f}x",
                 f"{s['stored_floats']:,}", f"{s['test_auc']:.4f}", f"{s['auc_gap']:+.4f}",
                 f"{s['auc_gap_sd']:.4f}", f"{s['auc_gap_se']:.4f}",
                 ", ".join(f"{g:+.4f}" for g in s["auc_gaps"])] for s in cells if s is not full]
        lines += [f"## Embedding dim {dim} (full tables: {full['stored_floats']:,} floats, mean "
                  f"test AUC {full['test_auc']:.4f})", "",
                  *table(["embeddings", "Z", "hash", "compression", "stored floats",
                          "mean test AUC", "AUC - full, mean", "sd", "se", f"per {key}"], rows),
                  "", *target_lines(cells), ""]
    if result["oracle"]:
        means = {name: mean_and_spread([o[name] for o in result["oracle"]])[0]
                 for name in result["oracle"][0]}
        lines += ["## References (no training, mean over seeds)", "",
                  *table(["reference", "test AUC"], [[n, f"{v:.4f}"] for n, v in means.items()])]
    return lines


def plot(result: Dict, path: str) -> None:
    """The gaps (mean +- sd) against the compression and against the stored floats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, robe = result["args"], [s for s in result["summary"] if s["embedding"] == "robe"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for (dim, h, z), marker in zip(itertools.product(a["dims"], a["hashes"], a["block_sizes"]),
                                   "osd^v<>ph*"):
        pts = sorted((s["compression"], s["stored_floats"], s["auc_gap"], s["auc_gap_sd"])
                     for s in robe if (s["dim"], s["hash"], s["block_size"]) == (dim, h, z))
        for ax, x in zip(axes, (0, 1)):
            ax.errorbar([p[x] for p in pts], [p[2] for p in pts], [p[3] for p in pts],
                        marker=marker, capsize=2, label=f"dim {dim}, Z={z}, {h} hash")
    for ax, xlabel in zip(axes, ("compression", "stored floats of the ROBE-Z array")):
        ax.set(xscale="log", xlabel=xlabel)
        for gap in [0.0] + [-g for g in TARGET_GAPS.values()]:  # red: the targets
            ax.axhline(gap, color="black" if gap == 0 else "tab:red", linewidth=0.8)
    axes[0].set_ylabel("test AUC - full tables of the same dim (mean +- sd)")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    p = parser("quality_study", __doc__)
    p.add_argument("--data", choices=("synthetic", "real"), default="synthetic")
    p.add_argument("--mode", choices=("realistic", "hard"), default="realistic", help="synthetic")
    p.add_argument("--seeds", "--splits", dest="replicates", type=int, nargs="+", default=None,
                   help="synthetic: the seeds (default 0 1 2); real: how many splits (default 5)")
    p.add_argument("--steps", type=int, default=None, help="synthetic (default 200)")
    p.add_argument("--epochs", type=int, default=2, help="real")
    p.add_argument("--batch-size", type=int, default=None, help="default 512; real 256")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 128])
    p.add_argument("--cardinality-scale", type=float, default=0.01, help="synthetic")
    p.add_argument("--test-batches", type=int, default=16, help="synthetic")
    p.add_argument("--rows", default=REAL_ROWS, help="real: the Criteo TSV")
    p.add_argument("--test-fraction", type=float, default=0.2, help="real")
    p.add_argument("--compressions", type=float, nargs="+", default=[10, 100, 1000, 10000])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--hashes", nargs="+", default=None,
                   help="default: reference mix; real: reference")
    p.add_argument("--name", default=None, help="stem of the result files")
    p.add_argument("--out", default=None, help="folder for <name>.{md,json} (and .png)")
    args = p.parse_args(argv)
    real = args.data == "real"
    for option, defaults in DEFAULTS.items():
        if getattr(args, option) is None:
            setattr(args, option, defaults[real])
    if real and isinstance(args.replicates, list):
        args.replicates = args.replicates[0]
    args.name = args.name or ("real_rows_study" if real else f"quality_study_{args.mode}")
    torch.set_num_threads(1)
    t0, key = time.perf_counter(), "split" if real else "seed"
    rows, oracle = [], []
    replicates = real_replicates(args) if real else synthetic_replicates(args)
    for replicate, train_batches, test, keys, cards, refs in replicates:
        rows += train_cells(args, key, replicate, train_batches, test, keys, cards)
        oracle += [refs] if refs else []
    result = {"command": command_line("quality_study", argv), "args": vars(args), "replicate": key,
              "rows": rows, "summary": summary(rows, key), "oracle": oracle,
              "seconds": time.perf_counter() - t0}
    publish(args.out, args.name, markdown(result, argv), result)
    if args.out and not real:
        plot(result, os.path.join(args.out, f"{args.name}.png"))
    return result


if __name__ == "__main__":
    main()
