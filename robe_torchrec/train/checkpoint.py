"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizers (dense and
fused), step, data position and every rank's RNG state, under ``<run dir>/checkpoints``.

A checkpoint is written to ``step_N.tmp`` and renamed to ``step_N`` by rank 0 once every rank
has written (DCP writes its metadata last), so a run killed mid-save leaves no half
checkpoint behind that a restart could pick. Checkpoints go on a file system every rank sees.

Each checkpoint also holds ``manifest.json``: the run id, the step, what the caller passes
(the app: its resume-relevant config) and a SHA-256 of every file, so a checkpoint changed
after it was written (truncated, bit-flipped, half-copied) is told apart before DCP reads
it (:meth:`Checkpointer.verify`). Rotation only removes older checkpoints of the same run.
A failed save (disk full, I/O error) removes its ``step_N.tmp`` and raises
:class:`CheckpointSaveError` saying why; the checkpoints before it stay.

Example::

    >>> ckpt = Checkpointer(run_dir / "checkpoints", keep=2, run_id="3f2a9c1b7d4e")
    >>> ckpt.save(100, dmp, optimizer, meta={"config": {...}})   # collective
    >>> path = ckpt.latest()                          # same answer on every rank
    >>> ckpt.verify(path)                             # None, or what is wrong (collective)
    >>> step = ckpt.load(path, dmp, optimizer)        # collective; returns the step
    >>> step = ckpt.load_model(path, dmp)             # the weights only (eval), any world size
    >>> step = load_unsharded(path, predict_model)    # one process, no process group needed
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper

# reading a checkpoint without running code from it (importable from here too)
from robe_torchrec.safe_dcp import (CheckpointError, SafeFileSystemReader, SafeLoadPlanner,
                                    UnsafeCheckpointError, read_metadata_safely, safe_load)

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STEP_ANY = re.compile(r"^step_(\d+)(\.bad|\.tmp)?$")
MANIFEST = "manifest.json"
#: a save failing with less free space than this is reported as a full disk
_FULL_BYTES = 1 << 20


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


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (the message says why: disk full, I/O error ...);
    its partial ``step_N.tmp`` is removed and the earlier checkpoints are kept."""


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its result on every rank; an exception there is raised on every
    rank (a copy of it off rank 0), so no rank is left waiting in a collective."""
    out: List[Any] = [None, None]
    err: Optional[BaseException] = None
    if dist.get_rank() == 0:
        try:
            out[0] = fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank below
            err = e
            try:
                pickle.dumps(e)
                out[1] = e
            except Exception:  # noqa: BLE001 - an exception that does not pickle
                out[1] = RuntimeError(f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        raise err if err is not None else out[1]
    return out[0]


def _errno(exc: BaseException) -> Optional[int]:
    """The errno of the first OSError in ``exc``, its causes, or DCP's per-rank failures."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        if isinstance(e, CheckpointException):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in e.failures.values())
        todo.extend([e.__cause__, e.__context__])
    return None


def _free_bytes(path: Path) -> Optional[int]:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _why_save_failed(exc: BaseException, directory: Path) -> str:
    code, free = _errno(exc), _free_bytes(directory)
    if code == errno.ENOSPC or (free is not None and free < _FULL_BYTES):
        return (f"the disk is full (no space left on device, ENOSPC; {free} bytes free on "
                f"the file system of {directory})")
    if code == errno.EDQUOT:
        return "the disk quota is exceeded (EDQUOT)"
    if code == errno.EIO:
        return "an I/O error (EIO) on the checkpoint file system"
    if code is not None:
        return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _checksums(directory: Path, names: List[str]) -> Dict[str, Optional[str]]:
    """SHA-256 of ``directory/name`` for every name, each rank hashing its share
    (collective); None for a file that cannot be read."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if _collective() else (0, 1)
    mine: Dict[str, Optional[str]] = {}
    for name in names[rank::world]:
        try:
            mine[name] = _sha256(directory / name)
        except OSError:
            mine[name] = None
    if world == 1:
        return mine
    every: List[Optional[Dict[str, Optional[str]]]] = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in (part or {}).items()}


def read_manifest(path: "str | os.PathLike") -> Optional[Dict[str, Any]]:
    """The manifest of checkpoint ``path`` (None when it has none: written by an older
    version); raises :class:`CheckpointError` when it is there but unreadable."""
    file = Path(path) / MANIFEST
    if not file.exists():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable manifest ({e})") from e


def _collective() -> bool:
    return dist.is_available() and dist.is_initialized()


def verify_checkpoint(path: "str | os.PathLike", allow_unverified: bool = False
                      ) -> Optional[str]:
    """What is wrong with checkpoint ``path``, or None (see :meth:`Checkpointer.verify`).
    Collective inside a process group (each rank hashes a share); alone without one."""
    path = Path(path)

    def listing():
        if not path.is_dir():
            raise CheckpointError(f"{path} is not a checkpoint directory")
        manifest = read_manifest(path)
        present = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
        return manifest, present

    try:
        manifest, present = on_rank0(listing) if _collective() else listing()
    except (CheckpointError, OSError) as e:
        return str(e)
    main = not _collective() or dist.get_rank() == 0
    if manifest is None:
        if not allow_unverified:
            return (f"it has no {MANIFEST} (written by an older version, or not by this "
                    f"app), so its files cannot be verified; to load it anyway, set "
                    f"run.allow_unverified=true")
        if main:
            log.warning("checkpoint %s has no %s: its files are not verified "
                        "(run.allow_unverified=true)", path, MANIFEST)
    else:
        expected = manifest.get("files")
        if not isinstance(expected, dict) or not expected:
            return f"{path / MANIFEST}: lists no files"
        missing = sorted(set(expected) - set(present))
        if missing:
            return f"file(s) missing: {', '.join(missing)}"
        got = _checksums(path, sorted(expected))
        changed = [n for n in sorted(expected) if got.get(n) != expected[n]]
        if changed:
            return (f"{', '.join(changed)}: checksum mismatch or unreadable (changed after "
                    f"it was written: truncated, overwritten or copied in part?)")

    def safe_metadata() -> None:
        read_metadata_safely(path)

    try:  # a manifest vouches for the bytes, not for what they are
        if _collective():
            on_rank0(safe_metadata)
        else:
            safe_metadata()
    except CheckpointError as e:
        return str(e)
    return None


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "symbolic link"
    return "regular file" if path.is_file() else "special file"


class Checkpointer:
    """Saves, finds, checks and loads the run's checkpoints (collective methods: call on
    every rank). ``run_id``: recorded in each checkpoint; rotation keeps the newest ``keep``
    checkpoints of this run id (``keep=0``: all) and never touches another run's."""

    def __init__(self, directory: "str | os.PathLike", keep: int = 2,
                 run_id: Optional[str] = None) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (0: keep all), got {keep}")
        self.dir = Path(directory)
        self.keep = keep
        self.run_id = run_id
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

    def candidates(self) -> List[Path]:
        """Every complete checkpoint, newest first (rank 0 looks, every rank gets it)."""
        found = [[str(p) for _, p in sorted(self._complete().items(), reverse=True)]
                 if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return [Path(p) for p in found[0]]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint (rank 0 looks, every rank gets its answer)."""
        found = self.candidates()
        return found[0] if found else None

    def verify(self, path: "str | os.PathLike", allow_unverified: bool = False
               ) -> Optional[str]:
        """What is wrong with checkpoint ``path`` (collective), or None: its files must be
        the ones its manifest lists, with the same SHA-256, and its DCP metadata must hold
        only DCP's metadata classes. A checkpoint without a manifest (an older version's,
        or not this app's) is refused unless ``allow_unverified``: then it passes with a
        warning."""
        return verify_checkpoint(path, allow_unverified)

    def history(self) -> List[Path]:
        """The checkpoints set aside as unusable (``step_N.bad``), newest first."""
        if not self.dir.is_dir():
            return []
        bad = [p for p in self.dir.iterdir() if p.name.endswith(".bad")
               and _STEP_ANY.match(p.name)]
        return sorted(bad, key=lambda p: int(_STEP_ANY.match(p.name).group(1)), reverse=True)

    def tidy(self) -> List[str]:
        """Before the first step (rank 0): remove the ``step_N.tmp`` directories that a run
        killed during a save left; refuse a ``step_N`` that is not a directory (every save
        of step N would fail on it). Returns the names removed."""
        if not self.dir.is_dir():
            return []
        removed = []
        for p in sorted(self.dir.iterdir()):
            m = _STEP_ANY.match(p.name)
            if not m:
                continue
            if m.group(2) == ".tmp":
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p.name)
            elif m.group(2) is None and not p.is_dir():
                raise CheckpointError(
                    f"{p} is not a checkpoint directory (a {_kind(p)}): every save of step "
                    f"{m.group(1)} would fail on it. Remove or rename it, then start again")
        return removed

    def quarantine(self, path: Path, reason: str) -> None:
        """Rename a bad checkpoint to ``step_N.bad`` (kept for inspection, never picked or
        rotated again); collective."""
        def move():
            target = path.with_name(path.name + ".bad")
            shutil.rmtree(target, ignore_errors=True)
            path.rename(target)
            (target / "WHY").write_text(reason + "\n")
            return target

        try:
            target = on_rank0(move)
            if self.rank == 0:
                log.warning("moved the unusable checkpoint %s to %s", path, target)
        except OSError as e:
            log.warning("could not move the unusable checkpoint %s aside: %s", path, e)

    def save(self, step: int, model: nn.Module, optimizer: KeyedOptimizer,
             meta: Optional[Dict[str, Any]] = None) -> Path:
        """Write checkpoint ``step_N`` (collective); ``meta`` goes into its manifest."""
        final = self.dir / f"step_{step}"
        tmp = self.dir / f"step_{step}.tmp"

        def start():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        def finish():
            present = sorted(p.name for p in tmp.iterdir())
            return present

        try:
            on_rank0(start)
            dcp.save(_state(model, optimizer, step, self.rank), checkpoint_id=str(tmp))
            files = _checksums(tmp, on_rank0(finish))
            manifest = {"run_id": self.run_id, "step": step,
                        "world_size": dist.get_world_size(), **(meta or {}), "files": files}
            on_rank0(lambda: self._publish(tmp, final, manifest))
        except (Exception, CheckpointException) as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            kept = [str(p) for p in self.candidates() if p != final]
            raise CheckpointSaveError(
                f"saving checkpoint {final} failed: {_why_save_failed(e, self.dir)}. The "
                f"partial {tmp.name} was removed; "
                + (f"the newest checkpoint kept is {kept[0]}" if kept else
                   "there is no earlier checkpoint")) from e
        on_rank0(lambda: self._rotate(step))
        return final

    def _publish(self, tmp: Path, final: Path, manifest: Dict[str, Any]) -> None:
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)

    def _rotate(self, saved: int) -> None:
        """Remove this run's checkpoints older than ``saved`` beyond the newest ``keep``."""
        if self.keep <= 0:
            return
        ours = []
        for step, path in sorted(self._complete().items()):
            try:
                manifest = read_manifest(path)
            except CheckpointError:
                continue
            if step < saved and manifest is not None and manifest.get("run_id") == self.run_id:
                ours.append(path)
        for path in ours[:max(len(ours) - (self.keep - 1), 0)]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: "str | os.PathLike", model: nn.Module, optimizer: KeyedOptimizer) -> int:
        """Load a checkpoint into ``model`` and ``optimizer`` in place; returns its step."""
        _init_lazy_state(optimizer)
        state = _state(model, optimizer, 0, self.rank)
        saved = read_metadata_safely(path).state_dict_metadata
        rng_key = _rng_key(self.rank)
        if not any(k.startswith(rng_key + ".") or k == rng_key for k in saved):
            log.warning("checkpoint %s has no RNG state for rank %d (saved with another world "
                        "size?): the RNG is not restored", path, self.rank)
            del state[rng_key]
        safe_load(state, path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        if rng_key in state:
            torch.set_rng_state(state[rng_key]["torch"])
        return int(state["trainer"]["step"])

    def load_model(self, path: "str | os.PathLike", model: nn.Module) -> int:
        """Load only the model of a checkpoint into ``model`` (collective; saved on any world
        size and plan, DCP reshards); returns its step."""
        state = {"model": model.state_dict(), "trainer": {"step": torch.tensor(0)}}
        safe_load(state, path)
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
    safe_load(state, path, no_dist=True)
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


__all__ = ["MANIFEST", "CheckpointError", "CheckpointException", "CheckpointSaveError",
           "Checkpointer", "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError",
           "load_unsharded", "on_rank0", "read_manifest", "read_metadata_safely", "safe_load",
           "verify_checkpoint"]
