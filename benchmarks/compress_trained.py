"""What does compressing a trained full-table DLRM into ROBE-Z cost, against training ROBE-Z
from scratch? Realistic synthetic data, :mod:`benchmarks.train_loop`.

Per seed: the full-table DLRM trained ``--steps`` steps; at each compression, the ROBE-Z
array fitted to its tables (``RobeEmbeddingBagCollection.from_embedding_bag_collection``,
weighted by lookup counts, and uniform) under its dense layers, scored untrained and after
``--finetune`` more steps at ``--finetune-lr`` (a fresh Adagrad's first steps would undo the
fit); beside it ROBE-Z trained from scratch for the same total steps::

    python -m benchmarks.compress_trained --out benchmarks/results
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.common import command_line, header, parser, publish, table
from benchmarks.train_loop import LR, build, group_by, mean_and_spread, quality_spec, score, train
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.train.data import TEST_STREAM_START


def id_counts(batches, keys, cardinalities) -> Dict[str, torch.Tensor]:
    """Look-ups per row of each table ``t_<key>`` over ``batches``."""
    return {f"t_{k}": sum(torch.bincount(b.sparse_features[k].values(), minlength=n).float()
                          for b in batches) for k, n in zip(keys, cardinalities)}


def run_seed(args: argparse.Namespace, seed: int) -> List[Dict]:
    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                           seed=seed, mode="realistic")
    finetune = args.finetune if args.finetune is not None else args.steps // 10
    stream = [data.batch(i) for i in range(args.steps + finetune)]
    first, more = stream[:args.steps], stream[args.steps:]
    test = [data.batch(TEST_STREAM_START + i) for i in range(args.test_batches)]
    full_spec = quality_spec(args.dim, None)
    full = build(full_spec, data.keys, data.cardinalities, seed)
    train(full, full_spec, first)
    rows = [("full tables", 1.0, args.steps, score(full, test)[0])]
    counts = id_counts(first, data.keys, data.cardinalities)
    for c in args.compressions:
        spec = quality_spec(args.dim, RobeConfig(compression=c, block_size=args.block_size,
                                                 seed=1024 + seed))
        for weights, w in (("counts", counts), ("uniform", None)):
            fitted = RobeEmbeddingBagCollection.from_embedding_bag_collection(
                full.sparse_arch.embedding_bag_collection, spec.robe, w)
            model = build(spec, data.keys, data.cardinalities, seed, embeddings=fitted)
            for part in ("dense_arch", "inter_arch", "over_arch"):
                getattr(model, part).load_state_dict(getattr(full, part).state_dict())
            rows.append((f"compressed ({weights}), no training", c, args.steps,
                         score(model, test)[0]))
            train(model, quality_spec(args.dim, spec.robe, args.finetune_lr), more)
            rows.append((f"compressed ({weights}) + {finetune} steps", c, args.steps + finetune,
                         score(model, test)[0]))
        scratch = build(spec, data.keys, data.cardinalities, seed)
        train(scratch, spec, stream)
        rows.append(("ROBE-Z from scratch", c, args.steps + finetune, score(scratch, test)[0]))
    for model, c, steps, auc in rows:
        print(f"seed {seed} {c:,.0f}x {model}: AUC {auc:.4f}", flush=True)
    return [{"seed": seed, "model": model, "compression": c, "steps": steps, "test_auc": auc,
             "auc_gap": auc - rows[0][3]} for model, c, steps, auc in rows]


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    p = parser("compress_trained", __doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--finetune", type=int, default=None, help="default: steps // 10")
    p.add_argument("--finetune-lr", type=float, default=0.005)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--cardinality-scale", type=float, default=0.01)
    p.add_argument("--test-batches", type=int, default=16)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--compressions", type=float, nargs="+", default=[100, 1000])
    p.add_argument("--out", default=None, help="a folder (compress_trained.md) or a .md file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = [r for seed in args.seeds for r in run_seed(args, seed)]
    cells = [[f"{c:,.0f}x", model, steps, f"{mean_and_spread([r['test_auc'] for r in rs])[0]:.4f}",
              *(f"{v:+.4f}" if i == 0 else f"{v:.4f}" for i, v in
                enumerate(mean_and_spread([r["auc_gap"] for r in rs])[:2]))]
             for (c, model, steps), rs in group_by(rows, ("compression", "model", "steps")).items()]
    lines = header("Compressing a trained full-table DLRM into ROBE-Z (realistic synthetic data)",
                   command_line("compress_trained", argv),
                   f"setup: dim {args.dim}, Z = {args.block_size}, reference hash, batch "
                   f"{args.batch_size}, cardinality scale {args.cardinality_scale}, seeds "
                   f"{args.seeds}; training at learning rate {LR}, fine-tuning at "
                   f"{args.finetune_lr}; test AUC on {args.test_batches * args.batch_size:,} "
                   f"held-out samples; AUC - full against the full model of the same seed, then "
                   f"mean and sd over the seeds; {(time.perf_counter() - t0) / 60:.1f} min")
    lines += table(["compression", "model", "steps", "mean test AUC", "AUC - full, mean", "sd"],
                   cells)
    result = {"command": command_line("compress_trained", argv), "args": vars(args), "rows": rows}
    publish(args.out, "compress_trained", lines, result)
    return result


if __name__ == "__main__":
    main()
