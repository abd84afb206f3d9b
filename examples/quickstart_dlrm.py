"""Train TorchRec's DLRM with ROBE-Z embeddings on synthetic Criteo-like data (CPU).

The only change from a stock TorchRec DLRM is the embedding module:
``EmbeddingBagCollection(tables)`` becomes ``RobeEmbeddingBagCollection(tables, RobeConfig(...))``.
Its array is trained by Adagrad fused into backward (``apply_optimizer_in_backward``); the
dense layers by a regular optimizer.

Run::

    python examples/quickstart_dlrm.py --steps 300 --compression 1000
"""

from __future__ import annotations

import argparse
import time

import torch
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.data.synthetic import SyntheticCriteo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--compression", type=float, default=1000.0)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--hash", default="reference", choices=["reference", "mix"])
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale,
                           seed=args.seed)
    tables = [
        EmbeddingBagConfig(name=f"t_{key}", embedding_dim=args.embedding_dim,
                           num_embeddings=rows, feature_names=[key])
        for key, rows in zip(data.keys, data.cardinalities)
    ]
    embeddings = RobeEmbeddingBagCollection(
        tables, RobeConfig(compression=args.compression, block_size=args.block_size, hash=args.hash))
    model = DLRM(
        embedding_bag_collection=embeddings,
        dense_in_features=data.num_dense,
        dense_arch_layer_sizes=[64, args.embedding_dim],
        over_arch_layer_sizes=[64, 32, 1],
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, embeddings.parameters(), {"lr": 0.05})
    dense_optimizer = torch.optim.Adagrad(
        dict(in_backward_optimizer_filter(model.named_parameters())).values(), lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    print(f"ROBE-Z embeddings: {embeddings.uncompressed_size:,} floats compressed to "
          f"{embeddings.memory_size:,} ({embeddings.compression_ratio:.0f}x, "
          f"{embeddings.memory_size * 4 / 2**20:.2f} MiB), block size {args.block_size}, "
          f"{args.hash} hash")

    window_loss, window_start, window_steps = 0.0, time.perf_counter(), 0
    for step, batch in enumerate(data.batches(count=args.steps), start=1):
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = loss_fn(logits, batch.labels)
        dense_optimizer.zero_grad()
        loss.backward()  # the ROBE array is updated here, by the fused Adagrad
        dense_optimizer.step()

        window_loss += loss.item()
        window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - window_start
            print(f"step {step:5d}  loss {window_loss / window_steps:.4f}  "
                  f"{window_steps * args.batch_size / elapsed:,.0f} samples/s")
            window_loss, window_start, window_steps = 0.0, time.perf_counter(), 0

    model.eval()
    auc = BinaryAUROC()
    with torch.no_grad():
        for batch in data.batches(start=10**6, count=8):  # held-out batches
            auc.update(torch.sigmoid(model(batch.dense_features, batch.sparse_features).squeeze(-1)),
                       batch.labels.long())
    print(f"held-out AUC {auc.compute().item():.4f}")


if __name__ == "__main__":
    main()
