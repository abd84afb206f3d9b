"""A two-tower retrieval model over item-id sequences with ROBE-Z (CPU, synthetic data).

The user tower reads the user's history of item ids through ``RobeEmbeddingCollection`` (one
embedding per id, as TorchRec's ``EmbeddingCollection``) and pools it (mean or attention);
the item tower reads the candidate item id from the same ROBE table. A click is a dot product
of the two towers. Items belong to hidden topics and users click items of their own topics,
so the model must learn item embeddings that group by topic. The item table is compressed
by ``--compression``; its array is trained by Adagrad fused into backward.

Run::

    python examples/sequence_two_tower.py --steps 400 --pooling attention
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, Tuple

import torch
from torch import nn
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingConfig, JaggedTensor, KeyedJaggedTensor
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec import RobeConfig, RobeEmbeddingCollection


class SyntheticHistories:
    """Users with a hidden topic, histories of 1..max_len items mostly of that topic, and a
    candidate item: a click (label 1) when the candidate's topic is the user's."""

    def __init__(self, num_items: int, topics: int, max_len: int, seed: int) -> None:
        self.num_items, self.topics, self.max_len = num_items, topics, max_len
        self.generator = torch.Generator().manual_seed(seed)

    def _items_of(self, topic: torch.Tensor) -> torch.Tensor:
        # item i has topic i % topics
        slots = torch.randint(0, self.num_items // self.topics, topic.shape,
                              generator=self.generator)
        return slots * self.topics + topic

    def batch(self, size: int) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
        g = self.generator
        topic = torch.randint(0, self.topics, (size,), generator=g)
        lengths = torch.randint(1, self.max_len + 1, (size,), generator=g)
        history_topic = torch.repeat_interleave(topic, lengths)
        noise = torch.rand(history_topic.shape, generator=g) < 0.2  # some off-topic views
        history_topic = torch.where(
            noise, torch.randint(0, self.topics, history_topic.shape, generator=g), history_topic)
        label = (torch.rand(size, generator=g) < 0.5).float()
        other = (topic + torch.randint(1, self.topics, (size,), generator=g)) % self.topics
        candidate = self._items_of(torch.where(label.bool(), topic, other))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["history", "candidate"],
            values=torch.cat([self._items_of(history_topic), candidate]),
            lengths=torch.cat([lengths, torch.ones(size, dtype=torch.long)]))
        return kjt, label


def pool(jt: JaggedTensor, scores: torch.Tensor = None) -> torch.Tensor:
    """``[bags, dim]``: the mean of each bag's embeddings, or with ``scores`` (one per id)
    their softmax-weighted sum within the bag."""
    lengths = jt.lengths()
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    values = jt.values()
    if scores is None:
        weights = 1.0 / lengths.clamp(min=1)[bag].to(values.dtype)
    else:
        # softmax per bag; the global max keeps exp() finite and cancels out
        e = torch.exp(scores - scores.max().detach())
        weights = e / torch.zeros(lengths.numel()).index_add(0, bag, e)[bag]
    return torch.zeros(lengths.numel(), values.shape[1]).index_add(0, bag, values * weights[:, None])


class TwoTower(nn.Module):
    def __init__(self, items: RobeEmbeddingCollection, dim: int, pooling: str) -> None:
        super().__init__()
        self.items = items
        self.attention = nn.Linear(dim, 1) if pooling == "attention" else None
        # towers start as the identity, so the first gradients reach the embeddings whole
        self.user_tower = nn.Linear(dim, dim)
        self.item_tower = nn.Linear(dim, dim)
        for tower in (self.user_tower, self.item_tower):
            nn.init.eye_(tower.weight)
            nn.init.zeros_(tower.bias)
        self.scale = nn.Parameter(torch.tensor(10.0))
        self.bias = nn.Parameter(torch.tensor(0.0))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        embedded: Dict[str, JaggedTensor] = self.items(kjt)
        history = embedded["history"]
        scores = None if self.attention is None else self.attention(history.values())[:, 0]
        user = self.user_tower(pool(history, scores))
        item = self.item_tower(embedded["candidate"].values())  # one id per sample
        return self.scale * (user * item).sum(dim=1) + self.bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-items", type=int, default=20_000)
    parser.add_argument("--topics", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=20)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--compression", type=float, default=10.0)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--pooling", default="mean", choices=["mean", "attention"])
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    table = EmbeddingConfig(name="items", embedding_dim=args.embedding_dim,
                            num_embeddings=args.num_items, feature_names=["history", "candidate"])
    items = RobeEmbeddingCollection([table], RobeConfig(compression=args.compression,
                                                        block_size=args.block_size,
                                                        init_scale=0.1))
    print(f"item table {args.num_items} x {args.embedding_dim} compressed to "
          f"{items.memory_size} floats ({items.compression_ratio:.0f}x)")
    model = TwoTower(items, args.embedding_dim, args.pooling)
    apply_optimizer_in_backward(torch.optim.Adagrad, [items.weight], {"lr": 0.1})
    dense = torch.optim.Adam([p for _, p in in_backward_optimizer_filter(model.named_parameters())],
                             lr=3e-3)
    data = SyntheticHistories(args.num_items, args.topics, args.max_len, args.seed)
    loss_fn = nn.BCEWithLogitsLoss()
    start, window = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        kjt, label = data.batch(args.batch_size)
        loss = loss_fn(model(kjt), label)
        dense.zero_grad()
        loss.backward()  # also updates the ROBE array (fused Adagrad)
        dense.step()
        window.append(loss.item())
        if step % args.log_every == 0:
            print(f"step {step:5d}  loss {sum(window) / len(window):.4f}")
            window = []
    seconds = time.perf_counter() - start
    print(f"{args.steps * args.batch_size / seconds:.0f} samples/s")

    auc = BinaryAUROC()
    held_out = SyntheticHistories(args.num_items, args.topics, args.max_len, args.seed + 1)
    with torch.no_grad():
        for _ in range(8):
            kjt, label = held_out.batch(args.batch_size)
            auc.update(torch.sigmoid(model(kjt)), label.long())
    print(f"held-out AUC {auc.compute().item():.4f}")


if __name__ == "__main__":
    main()
