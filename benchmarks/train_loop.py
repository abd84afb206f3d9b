"""In-process DLRM training and scoring for the quality benchmarks (one process, one thread,
no DMP): the same ``robe_torchrec.dlrm`` model the app trains, its embedding optimizer
applied in backward, on batches a study generates once and reuses for every row.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.utils import Batch
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec.config import RobeConfig
from robe_torchrec.dlrm import DLRMSpec, OptimizerSpec, build_predict_model

#: the fields that name one cell of a study (its rows differ by seed or split only)
CELL = ("dim", "embedding", "block_size", "hash", "compression")
#: the app's defaults (configs/model/dlrm.yaml, configs/optimizer/adagrad.yaml)
LR = 0.05


def quality_spec(dim: int, robe: Optional[RobeConfig], lr: float = LR) -> DLRMSpec:
    return DLRMSpec(robe=robe, embedding_dim=dim, dense_arch=(64, dim), over_arch=(64, 32, 1),
                    fast_interaction=True,
                    embedding_optimizer=OptimizerSpec("adagrad", lr=lr, eps=1e-10),
                    dense_optimizer=OptimizerSpec("adagrad", lr=lr, eps=1e-10))


def build(spec: DLRMSpec, keys: Sequence[str], cardinalities: Sequence[int], seed: int,
          embeddings: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    """The predict model of ``spec`` (dense layers from ``torch.manual_seed(seed)``), or of
    ``spec`` around the given ``embeddings`` module."""
    torch.manual_seed(seed)
    model, _ = build_predict_model(spec, keys, cardinalities)
    if embeddings is not None:
        model.sparse_arch.embedding_bag_collection = embeddings
    if spec.robe is None:
        # sparse gradients: Adagrad then touches only the rows a batch looked up, the same
        # update as dense Adagrad (a zero gradient leaves a row and its state alone) at a
        # fraction of the cost (the app's sharded TBE does the same)
        for bag in model.sparse_arch.embedding_bag_collection.embedding_bags.values():
            bag.sparse = True
    return model


def train(model: torch.nn.Module, spec: DLRMSpec, batches: Sequence[Batch]) -> None:
    """One pass of Adagrad over ``batches`` (embeddings: the optimizer fused into backward)."""
    ebc = model.sparse_arch.embedding_bag_collection
    apply_optimizer_in_backward(spec.embedding_optimizer.cls, list(ebc.parameters()),
                                spec.embedding_optimizer.kwargs())
    dense = spec.dense_optimizer.cls(
        dict(in_backward_optimizer_filter(model.named_parameters())).values(),
        **spec.dense_optimizer.kwargs())
    model.train()
    for batch in batches:
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        dense.zero_grad()
        loss.backward()
        dense.step()


def score(model: torch.nn.Module, batches: Sequence[Batch]) -> Tuple[float, float]:
    """(AUC, log loss) of ``model`` on ``batches``."""
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(b.dense_features, b.sparse_features).squeeze(-1)
                            for b in batches])
    labels = torch.cat([b.labels for b in batches])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).item()
    return binary_auroc(logits, labels.long()).item(), loss


def mean_and_spread(values: List[float]) -> Tuple[float, float, float]:
    """(mean, sample standard deviation, standard error) of ``values``."""
    t = torch.tensor(values, dtype=torch.float64)
    sd = t.std().item() if len(values) > 1 else 0.0
    return t.mean().item(), sd, sd / len(values) ** 0.5


def group_by(rows: List[Dict], fields: Sequence[str]) -> Dict[tuple, List[Dict]]:
    """``rows`` grouped by the values of ``fields``, groups in order of first appearance."""
    groups: Dict[tuple, List[Dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[f] for f in fields), []).append(r)
    return groups


def with_gaps(rows: List[Dict]) -> List[Dict]:
    """Sets ``auc_gap`` of every row: its test AUC minus that of the full tables' row of the
    same dim."""
    full = {r["dim"]: r["test_auc"] for r in rows if r["embedding"] == "full"}
    for r in rows:
        r["auc_gap"] = r["test_auc"] - full[r["dim"]]
    return rows
