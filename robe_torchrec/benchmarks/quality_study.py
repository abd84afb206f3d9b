"""Quality study: test AUC of the ROBE-Z DLRM against compression, block size Z and hash mode,
next to the full-table DLRM, on the synthetic Criteo-like data; same steps, data and seeds
for every row.

Every row is one run of the training app (``robe_torchrec.train``), composed from
``configs/`` with Hydra's compose API and run in this process (a 1-rank gloo group), so the
study trains exactly what ``python -m robe_torchrec.train`` trains. Two reference rows need no
training: the hidden model that drew the labels (the best AUC any model can reach) and its
dense part alone (the best a model that ignores the sparse features can reach), both on the
same test batches.

Writes ``quality_study.{md,json,png}``.

Usage::

    python -m robe_torchrec.benchmarks.quality_study --out robe_torchrec/benchmarks/results
    python -m robe_torchrec.benchmarks.quality_study --steps 20 --compressions 100 \\
        --block-sizes 8 --hashes reference --out /tmp/q      # a quick check
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Dict, List, Sequence

import torch
from torchmetrics.functional.classification import binary_auroc

from robe_torchrec.benchmarks.report import machine_line, write_report
from robe_torchrec.data.synthetic import SyntheticCriteo

# where the training app's test stream starts (robe_torchrec.train.data)
from robe_torchrec.train.data import TEST_STREAM_START


def _run(overrides: Sequence[str]) -> Dict[str, float]:
    from hydra import compose, initialize_config_dir

    from robe_torchrec.train.config import config_dir
    from robe_torchrec.train.loop import train

    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    with tempfile.TemporaryDirectory() as run_dir:
        return train(cfg, run_dir)


def _oracle_aucs(args) -> Dict[str, float]:
    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                           seed=args.seed)
    batches = [data.batch(TEST_STREAM_START + i) for i in range(args.test_batches)]
    labels = torch.cat([b.labels for b in batches]).long()
    return {sparse_name: binary_auroc(torch.cat([data.hidden_logit(b, sparse) for b in batches]),
                                      labels).item()
            for sparse_name, sparse in (("hidden model (all features)", True),
                                        ("hidden model, dense features only", False))}


def _rows(args) -> List[Dict]:
    rows = [{"embedding": "full", "compression": 1.0, "block_size": None, "hash": None,
             "overrides": ["embedding=full"]}]
    for hash_mode in args.hashes:
        for z in args.block_sizes:
            for c in args.compressions:
                rows.append({"embedding": "robe", "compression": float(c), "block_size": z,
                             "hash": hash_mode,
                             "overrides": ["embedding=robe", f"embedding.compression={c}",
                                           f"embedding.block_size={z}",
                                           f"embedding.hash={hash_mode}"]})
    return rows


def _plot(result: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    robe = [r for r in result["rows"] if r["embedding"] == "robe"]
    for hash_mode in sorted({r["hash"] for r in robe}):
        for z in sorted({r["block_size"] for r in robe}):
            pts = sorted((r["compression"], r["test_auc"]) for r in robe
                         if r["hash"] == hash_mode and r["block_size"] == z)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if hash_mode == "reference" else "--",
                    label=f"ROBE-Z Z={z}, {hash_mode} hash")
    full = [r["test_auc"] for r in result["rows"] if r["embedding"] == "full"][0]
    ax.axhline(full, color="black", label="full tables")
    for (name, auc), color in zip(result["oracle"].items(), ("tab:gray", "tab:red")):
        ax.axhline(auc, color=color, linestyle=":", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("compression (uncompressed / stored floats)")
    ax.set_ylabel("test AUC")
    ax.set_title(f"DLRM on synthetic Criteo-like data, {result['args']['steps']} steps")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _markdown(result: Dict) -> str:
    a = result["args"]
    full = [r for r in result["rows"] if r["embedding"] == "full"][0]
    lines = [
        "# Quality study: AUC against compression, Z and hash (synthetic data)", "",
        f"`{result['command']}`", "",
        f"Machine: {result['machine']}. DLRM (configs/model/dlrm.yaml), embedding dim "
        f"{a['dim']}, Adagrad (embeddings fused into backward), {a['steps']} steps of batch "
        f"{a['batch_size']} on one rank (1 thread), synthetic data at cardinality scale "
        f"{a['cardinality_scale']} (full tables: {full['stored_floats']:,} floats), seed "
        f"{a['seed']} for the data and the model (hash seed: the config default); test AUC over "
        f"{a['test_batches'] * a['batch_size']:,} held-out samples.", "",
        "| embeddings | Z | hash | compression | stored floats | test AUC | AUC - full | "
        "test log loss |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['embedding']} | {r['block_size'] or '-'} | {r['hash'] or '-'} | "
            f"{r['compression']:,.0f}x | {r['stored_floats']:,} | {r['test_auc']:.4f} | "
            f"{r['test_auc'] - full['test_auc']:+.4f} | {r['test_log_loss']:.4f} |")
    lines += ["", "| reference (no training) | test AUC |", "|---|---:|"]
    lines += [f"| {name} | {auc:.4f} |" for name, auc in result["oracle"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    parser.add_argument("--test-batches", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compressions", type=float, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--hashes", nargs="+", default=["reference", "mix"])
    parser.add_argument("--out", default=None, help="folder for quality_study.{md,json,png}")
    args = parser.parse_args()

    from robe_torchrec.train.app import init_distributed

    init_distributed()
    common = [f"run.steps={args.steps}", f"run.batch_size={args.batch_size}",
              f"run.seed={args.seed}", f"data.seed={args.seed}",
              f"data.cardinality_scale={args.cardinality_scale}", f"embedding.dim={args.dim}",
              f"run.test_batches={args.test_batches}", "run.eval_batches=0", "run.log_every=0",
              "run.progress_bar=false", "run.checkpoint_every=0", "run.resume=false",
              "pipeline=plain", "optimizer=adagrad", "run.threads=1"]
    rows = _rows(args)
    for i, row in enumerate(rows):
        t0 = time.perf_counter()
        out = _run(common + row.pop("overrides"))
        row.update(test_auc=out["test_auc"], test_log_loss=out["test_log_loss"],
                   stored_floats=int(out["stored_floats"]), seconds=time.perf_counter() - t0)
        print(f"[{i + 1}/{len(rows)}] {row['embedding']} Z={row['block_size']} {row['hash']} "
              f"{row['compression']:,.0f}x: test AUC {row['test_auc']:.4f} "
              f"({row['seconds']:.0f} s)", flush=True)
    result = {"command": "python -m robe_torchrec.benchmarks.quality_study " +
                         " ".join(os.sys.argv[1:]),
              "machine": machine_line(),
              "args": vars(args), "rows": rows, "oracle": _oracle_aucs(args)}
    text = _markdown(result)
    print(text)
    if args.out:
        write_report(args.out, "quality_study", result, text)
        _plot(result, os.path.join(args.out, "quality_study.png"))


if __name__ == "__main__":
    main()
