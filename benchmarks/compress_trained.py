"""Compressing a trained full-table DLRM into ROBE-Z, against training ROBE-Z from scratch, on
the realistic synthetic data.

For each seed: train the full-table DLRM for ``--steps`` steps; then, at each compression,
build the ROBE-Z module whose array is the least-squares fit of the trained tables
(``RobeEmbeddingBagCollection.from_embedding_bag_collection``; weighted by how often the
training batches looked each id up, and uniform), keep the full model's dense layers, and
score it with no training and after ``--finetune`` more steps (10% of ``--steps`` by
default; the next batches of the stream) at ``--finetune-lr`` (a tenth of the training
rate by default: the Adagrad state starts afresh, and a fresh Adagrad's first steps move
every touched weight by about the learning rate, which undoes the fit); next to it, ROBE-Z trained
from scratch for the same total steps on the same batches. Training is
:mod:`benchmarks.train_loop` (the app's DLRM and Adagrad, one thread).

Usage::

    python -m benchmarks.compress_trained --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

import torch

from benchmarks.train_loop import build, group_by, mean_and_spread, quality_spec, score, train
from robe_torchrec.pipelines.report import machine, machine_line, write_report
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.train.data import TEST_STREAM_START


def id_counts(batches, keys, cardinalities) -> Dict[str, torch.Tensor]:
    """Look-ups per row of each table ``t_<key>`` over ``batches``."""
    counts = {f"t_{k}": torch.zeros(n) for k, n in zip(keys, cardinalities)}
    for b in batches:
        for k in keys:
            counts[f"t_{k}"] += torch.bincount(b.sparse_features[k].values(),
                                               minlength=counts[f"t_{k}"].numel()).float()
    return counts


def _compressed(full, spec, data, seed: int, counts):
    robe_ebc = RobeEmbeddingBagCollection.from_embedding_bag_collection(
        full.sparse_arch.embedding_bag_collection, spec.robe, counts)
    model = build(spec, data.keys, data.cardinalities, seed, embeddings=robe_ebc)
    for part in ("dense_arch", "inter_arch", "over_arch"):
        getattr(model, part).load_state_dict(getattr(full, part).state_dict())
    return model


def _run_seed(args, seed: int) -> List[Dict]:
    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                           seed=seed, mode="realistic")
    finetune = args.finetune if args.finetune is not None else args.steps // 10
    stream = [data.batch(i) for i in range(args.steps + finetune)]
    first, more = stream[:args.steps], stream[args.steps:]
    test = [data.batch(TEST_STREAM_START + i) for i in range(args.test_batches)]
    full_spec = quality_spec(args.dim, None)
    full = build(full_spec, data.keys, data.cardinalities, seed)
    train(full, full_spec, first)
    full_auc = score(full, test)[0]
    rows = [{"seed": seed, "model": "full tables", "compression": 1.0,
             "steps": args.steps, "test_auc": full_auc}]
    counts = id_counts(first, data.keys, data.cardinalities)
    for c in args.compressions:
        spec = quality_spec(args.dim, RobeConfig(compression=c, block_size=args.block_size,
                                                 seed=1024 + seed))
        for weights, w in (("counts", counts), ("uniform", None)):
            model = _compressed(full, spec, data, seed, w)
            rows.append({"seed": seed, "model": f"compressed ({weights}), no training",
                         "compression": c, "steps": args.steps,
                         "test_auc": score(model, test)[0]})
            train(model, quality_spec(args.dim, spec.robe, args.finetune_lr), more)
            rows.append({"seed": seed, "model": f"compressed ({weights}) + {finetune} steps",
                         "compression": c, "steps": args.steps + finetune,
                         "test_auc": score(model, test)[0]})
        scratch = build(spec, data.keys, data.cardinalities, seed)
        train(scratch, spec, stream)
        rows.append({"seed": seed, "model": "ROBE-Z from scratch", "compression": c,
                     "steps": args.steps + finetune, "test_auc": score(scratch, test)[0]})
    for r in rows:
        r["auc_gap"] = r["test_auc"] - full_auc
        print(f"seed {seed} {r['compression']:,.0f}x {r['model']}: AUC {r['test_auc']:.4f}",
              flush=True)
    return rows


def _markdown(result: Dict) -> str:
    a = result["args"]
    lines = [
        "# Compressing a trained full-table DLRM into ROBE-Z (realistic synthetic data)", "",
        f"`{result['command']}`", "",
        f"Machine: {machine_line(result['machine'])}. Dim {a['dim']}, Z = {a['block_size']}, "
        f"reference hash, batch {a['batch_size']}, cardinality scale {a['cardinality_scale']}, "
        f"seeds {a['seeds']}; training at learning rate 0.05, fine-tuning at "
        f"{a['finetune_lr']}; test AUC on {a['test_batches'] * a['batch_size']:,} held-out "
        f"samples; AUC - full is against the full model of the same seed, then mean and "
        f"standard deviation over the seeds. {result['seconds'] / 60:.1f} min.", "",
        "| compression | model | steps | mean test AUC | AUC - full, mean | sd |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for (c, model, steps), rs in group_by(result["rows"], ("compression", "model", "steps")).items():
        auc = mean_and_spread([r["test_auc"] for r in rs])[0]
        gap, sd, _ = mean_and_spread([r["auc_gap"] for r in rs])
        lines.append(f"| {c:,.0f}x | {model} | {steps} | {auc:.4f} | {gap:+.4f} | {sd:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--finetune", type=int, default=None, help="default: steps // 10")
    parser.add_argument("--finetune-lr", type=float, default=0.005)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    parser.add_argument("--test-batches", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--compressions", type=float, nargs="+", default=[100, 1000])
    parser.add_argument("--name", default="compress_trained")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = [r for seed in args.seeds for r in _run_seed(args, seed)]
    result = {"command": "python -m benchmarks.compress_trained " + " ".join(sys.argv[1:]),
              "machine": machine(), "args": vars(args), "rows": rows,
              "seconds": time.perf_counter() - t0}
    text = _markdown(result)
    print(text)
    if args.out:
        write_report(args.out, args.name, result, text)


if __name__ == "__main__":
    main()
