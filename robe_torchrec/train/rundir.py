"""One run per directory: a lock file naming its owner (host, pid), taken by rank 0 before
anything is written and released when the run ends.

A second run into a locked directory fails at once, naming the owner. A lock left by a
process that is gone (same host, pid not running), or by an earlier attempt of the same
elastic job (a ``torchrun --max-restarts`` restart), is taken over with a warning.

Example::

    >>> lock = RunLock("outputs/x")
    >>> lock.acquire()      # RunDirLocked("outputs/x is in use by pid 4242 on host a ...")
    >>> lock.release()
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"


class RunDirLocked(RuntimeError):
    """Another live run owns the run directory."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _elastic_attempt() -> Optional[tuple]:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not run_id or run_id == "none":
        return None
    return run_id, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class RunLock:
    """``<run dir>/.run.lock``: JSON with host, pid, start time and the elastic job id."""

    def __init__(self, run_dir: "str | os.PathLike") -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def _owner(self) -> dict:
        attempt = _elastic_attempt()
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "elastic_run_id": attempt[0] if attempt else None,
                "restart": attempt[1] if attempt else None}

    def _stale_reason(self, owner: dict) -> Optional[str]:
        """Why the lock of ``owner`` may be taken over, or None if its run may be alive."""
        attempt = _elastic_attempt()
        if attempt and owner.get("elastic_run_id") == attempt[0] \
                and (owner.get("restart") or 0) < attempt[1]:
            return f"left by attempt {owner.get('restart')} of this elastic job"
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) \
                and not _alive(owner["pid"]):
            return f"pid {owner['pid']} is not running"
        return None

    def acquire(self) -> None:
        """Take the lock (creating the run directory) or raise :class:`RunDirLocked`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    owner = {}  # being written right now, or garbage: treat as held
                stale = self._stale_reason(owner) if owner else None
                if stale is None:
                    raise RunDirLocked(
                        f"run directory {self.path.parent} is in use by pid "
                        f"{owner.get('pid', '?')} on host {owner.get('host', '?')} (since "
                        f"{owner.get('since', '?')}; lock file {self.path}). Use another run "
                        f"dir (hydra.run.dir=...), or stop that run; a lock whose process has "
                        f"died is taken over automatically.") from None
                log.warning("taking over the stale lock %s (%s)", self.path, stale)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._owner(), f)
            self.held = True
            return
        raise RunDirLocked(f"could not take the lock {self.path}: other processes keep "
                           f"taking it")

    def release(self) -> None:
        if not self.held:
            return
        try:
            owner = json.loads(self.path.read_text())
            if owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError) as e:
            if getattr(e, "errno", None) != errno.ENOENT:
                log.warning("could not release the lock %s: %s", self.path, e)
        self.held = False
