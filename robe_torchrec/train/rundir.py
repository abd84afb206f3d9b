"""One run per directory: rank 0 holds an OS lock (``fcntl.flock``) on ``<run dir>/.run.lock``
while the run lives; the file also names the owner (host, pid, start time) for messages.

The kernel keeps the lock: it is released when the owner's process ends, however it ends
(SIGKILL included), so a lock file left behind, whatever it holds (an owner that is gone,
nothing, garbage), is taken over by the next run, and two processes never both own it. A
second run into a directory whose owner lives fails at once, naming the owner.

Example::

    >>> lock = RunLock("outputs/x")
    >>> lock.acquire()      # RunDirLocked("outputs/x is in use by pid 4242 on host a ...")
    >>> lock.release()
"""

from __future__ import annotations

import errno
import fcntl
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


def _describe(text: str) -> str:
    """The owner a lock file names, for a message."""
    try:
        owner = json.loads(text)
    except ValueError:
        owner = None
    if not isinstance(owner, dict) or "pid" not in owner:
        return "a process that has not written its name yet"
    return (f"pid {owner.get('pid')} on host {owner.get('host')} (since "
            f"{owner.get('since')})")


class RunLock:
    """``<run dir>/.run.lock``: flock-ed by its owner; holds JSON with host, pid and start
    time."""

    def __init__(self, run_dir: "str | os.PathLike") -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def _owner(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> None:
        """Take the lock (creating the run directory) or raise :class:`RunDirLocked`."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunDirLocked(
                        f"run directory {self.path.parent} is in use by "
                        f"{_describe(self._read())} (lock file {self.path}, held by a live "
                        f"process). Use another run dir (hydra.run.dir=...), or stop that "
                        f"run; the lock of a process that has ended is taken over "
                        f"automatically.") from None
                raise RunDirLocked(
                    f"cannot lock {self.path}: {os.strerror(e.errno)} (the run directory's "
                    f"file system must support flock; on Lustre mount it with -o flock)"
                    ) from e
            # A releasing owner unlinks the file while holding it: a lock taken on that
            # unlinked file is worthless, so take the one now at the path.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            left = self._read_fd(fd)
            if left.strip():
                log.warning("taking over the lock %s left by %s, which has ended", self.path,
                            _describe(left))
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self._owner()).encode(), 0)
            self.fd = fd
            return
        raise RunDirLocked(f"could not take the lock {self.path}: other processes keep "
                           f"taking and releasing it")

    def _read(self) -> str:
        try:
            return self.path.read_text(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def _read_fd(fd: int) -> str:
        return os.pread(fd, 4096, 0).decode(errors="replace")

    def release(self) -> None:
        """Give the directory up (removing the lock file); the kernel does the same if the
        process ends first."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still held: see acquire
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("could not remove the lock file %s: %s", self.path, e)
        finally:
            os.close(self.fd)
            self.fd = None
