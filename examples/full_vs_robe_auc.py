"""Full embedding tables against ROBE-Z on the same DLRM, data, steps and seed: held-out AUC,
embedding memory and training speed side by side (CPU, one process).

Both models are TorchRec's ``DLRM``; only the embedding module differs, and both embedding
modules are trained by Adagrad applied in backward (``apply_optimizer_in_backward``).

Run::

    python examples/full_vs_robe_auc.py --steps 300 --compression 100 1000
"""

from __future__ import annotations

import argparse
import time

import torch
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.data.synthetic import SyntheticCriteo


def train_and_score(embeddings: torch.nn.Module, data: SyntheticCriteo, args) -> dict:
    """Train a DLRM over ``embeddings`` for ``args.steps`` steps; held-out AUC and speed."""
    model = DLRM(embedding_bag_collection=embeddings, dense_in_features=data.num_dense,
                 dense_arch_layer_sizes=[64, args.embedding_dim],
                 over_arch_layer_sizes=[64, 32, 1])
    apply_optimizer_in_backward(torch.optim.Adagrad, embeddings.parameters(), {"lr": args.lr})
    dense_optimizer = torch.optim.Adagrad(
        dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=args.lr)
    start = time.perf_counter()
    for batch in data.batches(count=args.steps):
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
    seconds = time.perf_counter() - start

    auc = BinaryAUROC()
    model.eval()
    with torch.no_grad():
        for batch in data.batches(start=10**6, count=args.eval_batches):  # held out
            auc.update(model(batch.dense_features, batch.sparse_features).squeeze(-1),
                       batch.labels.long())
    floats = sum(p.numel() for p in embeddings.parameters())
    return {"auc": auc.compute().item(), "floats": floats,
            "samples_per_s": args.steps * args.batch_size / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--compression", type=float, nargs="+", default=[100.0, 1000.0])
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                           seed=args.seed)
    tables = [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=args.embedding_dim,
                                 num_embeddings=rows, feature_names=[key])
              for key, rows in zip(data.keys, data.cardinalities)]
    candidates = {"full tables": lambda: EmbeddingBagCollection(tables)}
    for c in args.compression:
        candidates[f"ROBE-Z {c:,.0f}x"] = lambda c=c: RobeEmbeddingBagCollection(
            tables, RobeConfig(compression=c, block_size=args.block_size))

    print(f"{'embeddings':<16}{'floats':>12}{'MiB':>9}{'AUC':>8}{'samples/s':>11}")
    for name, make in candidates.items():
        torch.manual_seed(args.seed)  # same dense initialisation for every model
        r = train_and_score(make(), data, args)
        print(f"{name:<16}{r['floats']:>12,}{r['floats'] * 4 / 2**20:>9.2f}{r['auc']:>8.4f}"
              f"{r['samples_per_s']:>11,.0f}", flush=True)


if __name__ == "__main__":
    main()
