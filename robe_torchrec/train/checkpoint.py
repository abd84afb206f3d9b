"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizers (dense and
fused), step, data position and every rank's RNG state, under ``<run dir>/checkpoints``.

A checkpoint is written to ``step_N.tmp`` and renamed to ``step_N`` by rank 0 once every rank
has written (DCP writes its metadata last), so a run killed mid-save leaves no half
checkpoint behind that a restart could pick. Checkpoints go on a file system every rank sees.

Example::

    >>> ckpt = Checkpointer(run_dir / "checkpoints", keep=2)
    >>> ckpt.save(100, dmp, optimizer)                # collective
    >>> path = ckpt.latest()                          # same answer on every rank
    >>> step = ckpt.load(path, dmp, optimizer)        # collective; returns the step
    >>> step = ckpt.load_model(path, dmp)             # the weights only (eval), any world size
    >>> step = load_unsharded(path, predict_model)    # one process, no process group needed
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def _state(model: nn.Module, optimizer: KeyedOptimizer, step: int, rank: int) -> Dict[str, Any]:
    optimizer.save_param_groups(True)  # TorchRec leaves learning rates out by default
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        # batches are a function of the step in every data source (data.py), so the step is
        # the data position
        "trainer": {"step": torch.tensor(step), "data_position": torch.tensor(step)},
        # per-rank keys: DCP keeps one copy of a key that every rank saves
        _rng_key(rank): {"torch": torch.get_rng_state()},
    }


class Checkpointer:
    """Saves, finds and loads the run's checkpoints (collective methods: call on every rank)."""

    def __init__(self, directory: "str | os.PathLike", keep: int = 2) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self.rank = dist.get_rank()

    def _complete(self) -> Dict[int, Path]:
        if not self.dir.is_dir():
            return {}
        found = {}
        for p in self.dir.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / ".metadata").is_file():
                found[int(m.group(1))] = p
        return found

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (rank 0 looks, every rank gets its answer)."""
        found = [str(max(self._complete().items())[1]) if self._complete() else None]
        dist.broadcast_object_list(found, src=0)
        return Path(found[0]) if found[0] else None

    def save(self, step: int, model: nn.Module, optimizer: KeyedOptimizer) -> Path:
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"step_{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(_state(model, optimizer, step, self.rank), checkpoint_id=str(tmp))
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            for old in sorted(self._complete())[:-self.keep] if self.keep > 0 else []:
                shutil.rmtree(self._complete()[old], ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: "str | os.PathLike", model: nn.Module, optimizer: KeyedOptimizer) -> int:
        """Load a checkpoint into ``model`` and ``optimizer`` in place; returns its step."""
        _init_lazy_state(optimizer)
        state = _state(model, optimizer, 0, self.rank)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        rng_key = _rng_key(self.rank)
        if not any(k.startswith(rng_key + ".") or k == rng_key for k in saved):
            log.warning("checkpoint %s has no RNG state for rank %d (saved with another world "
                        "size?): the RNG is not restored", path, self.rank)
            del state[rng_key]
        dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        if rng_key in state:
            torch.set_rng_state(state[rng_key]["torch"])
        return int(state["trainer"]["step"])


    def load_model(self, path: "str | os.PathLike", model: nn.Module) -> int:
        """Load only the model of a checkpoint into ``model`` (collective; saved on any world
        size and plan, DCP reshards); returns its step."""
        state = {"model": model.state_dict(), "trainer": {"step": torch.tensor(0)}}
        dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
        return int(state["trainer"]["step"])


def load_unsharded(path: "str | os.PathLike", model: nn.Module, prefix: str = "model.") -> int:
    """Load the trained weights of a checkpoint into an unsharded ``model`` in this process
    alone (no collective: other ranks need not take part); returns the checkpoint's step.

    ``prefix``: where ``model``'s keys sit in the trained model; the app trains ``DLRMTrain``,
    whose ``model.`` is the predict model of :func:`robe_torchrec.dlrm.build_predict_model`.
    """
    own = model.state_dict()
    state = {"model": {prefix + k: v for k, v in own.items()}, "trainer": {"step": torch.tensor(0)}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict({k: state["model"][prefix + k] for k in own})
    return int(state["trainer"]["step"])


def _init_lazy_state(optimizer: KeyedOptimizer) -> None:
    """Materialise lazily created dense optimizer state (Adam's) so DCP can load into it
    (a zero-gradient step: parameters are overwritten by the load anyway). Fused
    optimizers hold their state from the start."""
    parts = [o for _, o in optimizer.optimizers] if isinstance(optimizer, CombinedOptimizer) \
        else [optimizer]
    for part in parts:
        if isinstance(part, KeyedOptimizerWrapper) and part.params and not part.state:
            part.init_state()
            part.zero_grad(set_to_none=True)
