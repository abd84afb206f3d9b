"""Metrics of a phase (AUC, log loss: torchmetrics, synced over ranks at ``compute``) and the
run's ``metrics.csv`` (written by rank 0; a resumed run drops the rows past its checkpoint
and appends, so each phase has at most one row per step), and with ``run.tensorboard=true``
the same values as TensorBoard scalars (``<phase>/auc``, ``<phase>/log_loss``,
``<phase>/samples_per_s``) in ``<run dir>/tensorboard/``.

Example::

    >>> m = PhaseMetrics()
    >>> m.update(logits, labels)
    >>> m.compute()                                  # collective: every rank calls it
    {'auc': 0.71, 'log_loss': 0.52, 'samples': 8192}
    >>> MetricsCsv("run/metrics.csv").write(phase="val", step=200, **m.compute())
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import BinaryAUROC


class PhaseMetrics:
    """AUC and log loss (mean binary cross-entropy) over the samples seen since ``reset``."""

    def __init__(self) -> None:
        self.auc = BinaryAUROC()
        self.log_loss = MeanMetric()
        self.samples = SumMetric()

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits = logits.detach().float().reshape(-1).cpu()
        labels = labels.detach().reshape(-1).cpu()
        self.auc.update(torch.sigmoid(logits), labels.long())
        self.log_loss.update(F.binary_cross_entropy_with_logits(logits, labels.float(),
                                                                reduction="none"))
        self.samples.update(labels.numel())

    def compute(self) -> Dict[str, float]:
        return {"auc": self.auc.compute().item(), "log_loss": self.log_loss.compute().item(),
                "samples": int(self.samples.compute().item())}

    def reset(self) -> None:
        for m in (self.auc, self.log_loss, self.samples):
            m.reset()


class MetricsCsv:
    """Rows of ``phase, step, samples, auc, log_loss, samples_per_s, elapsed_s`` (a no-op off
    rank 0)."""

    FIELDS = ("phase", "step", "samples", "auc", "log_loss", "samples_per_s", "elapsed_s")

    def __init__(self, path: "str | os.PathLike", enabled: bool = True,
                 tensorboard: "str | os.PathLike | None" = None) -> None:
        self.path = Path(path)
        self.enabled = enabled
        # each row also goes to a TensorBoard event file in this directory (rank 0)
        self.tensorboard = tensorboard_writer(tensorboard) if enabled and tensorboard else None

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def _rows(self) -> List[List[str]]:
        if not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            return list(csv.reader(f))[1:]

    def _rewrite(self, keep: Callable[[List[str]], bool]) -> int:
        """Keep the rows ``keep`` accepts; returns how many were dropped."""
        rows = self._rows()
        kept = [r for r in rows if keep(r)]
        if len(kept) != len(rows):
            tmp = self.path.with_suffix(".csv.tmp")
            with open(tmp, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(self.FIELDS)
                w.writerows(kept)
            os.replace(tmp, self.path)
        return len(rows) - len(kept)

    @property
    def dropped_path(self) -> Path:
        """Where :meth:`rewind` keeps the rows it drops: ``<name>.dropped.csv``."""
        return self.path.with_name(self.path.stem + ".dropped.csv")

    def rewind(self, step: int) -> int:
        """Drop the rows past ``step`` (a run resumed or rolled back there writes them
        again), appending them to :attr:`dropped_path` first, so no row is ever lost;
        returns how many were dropped."""
        if not self.enabled:
            return 0

        def keep(r: List[str]) -> bool:
            return len(r) > 1 and r[1].isdigit() and int(r[1]) <= step

        dropped = [r for r in self._rows() if not keep(r)]
        if dropped:
            new = not self.dropped_path.exists()
            with open(self.dropped_path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(self.FIELDS)
                w.writerows(dropped)
                f.flush()
                os.fsync(f.fileno())
        return self._rewrite(keep)

    def write(self, phase: str, step: int, samples: Optional[int] = None,
              auc: Optional[float] = None, log_loss: Optional[float] = None,
              samples_per_s: Optional[float] = None, elapsed_s: Optional[float] = None) -> None:
        """Append a row; one already there for the same phase and step is replaced."""
        if not self.enabled:
            return
        self._rewrite(lambda r: r[:2] != [phase, str(step)])
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(self.FIELDS)
            w.writerow([phase, step, samples, _fmt(auc), _fmt(log_loss), _fmt(samples_per_s),
                        _fmt(elapsed_s)])
        if self.tensorboard is not None:
            for name, value in (("auc", auc), ("log_loss", log_loss),
                                ("samples_per_s", samples_per_s)):
                if value is not None:
                    self.tensorboard.add_scalar(f"{phase}/{name}", value, step)
            self.tensorboard.flush()


def tensorboard_writer(path: "str | os.PathLike"):
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``path``; a clear error if the
    ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        from robe_torchrec.train.config import ConfigError

        raise ConfigError(f"run.tensorboard=true needs the tensorboard package ({e}): "
                          f"pip install tensorboard (the project's cpu and gpu extras have it), "
                          f"or run.tensorboard=false") from None
    return SummaryWriter(log_dir=os.fspath(path))


def _fmt(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.6g}"
