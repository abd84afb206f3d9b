"""Preemption: stop signals agreed on by every rank, and collectives that end instead of
blocking forever.

SIGTERM (what Kubernetes, Slurm and torchelastic send before killing) and SIGUSR1 (what
Slurm sends ahead of a time limit, with ``--signal``) only set a flag here. The trainer asks
:meth:`StopSignals.until_stopped` for its batches: each batch taken starts an all-reduce
(MAX) of the flag on a separate gloo group and reads the one started a batch earlier, which
has long finished, so the agreement costs no wait. Every rank reads the same results at the
same batch and so stops taking batches at the same one; the trainer then saves the step
reached and raises :class:`Stopped`.

Example::

    >>> signals = StopSignals(world_size, timedelta(minutes=30))
    >>> signals.install()                       # main thread; uninstall() restores
    >>> for batch in signals.until_stopped(batches): ...
    >>> signals.settle()                        # collective: 0, or the signal on any rank
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: the signals that stop a run at the next step, with a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Stopped(SystemExit):
    """The run stopped on a signal after saving the step it reached; the process exits
    with 128 + the signal's number, as if the signal had ended it (so a scheduler or
    torchrun counts the run as not finished)."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        super().__init__(128 + signum)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} at step {self.step}, "
                f"checkpoint {self.checkpoint.name}")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than ``run.collective_timeout``; the message names the
    ranks that did not answer."""


class StopSignals:
    """The stop flag of this rank and the one every rank agreed on (see module doc)."""

    def __init__(self, world_size: int, timeout: timedelta) -> None:
        self.local = 0
        self.agreed = 0
        self._previous: Dict[int, object] = {}
        self._work = None
        self._buf: Optional[torch.Tensor] = None
        # apart from the model's collectives, so an outstanding flag reduce never sits
        # between two of theirs
        self.group = dist.new_group(backend="gloo", timeout=timeout) if world_size > 1 else None

    def _handler(self, signum: int, frame) -> None:
        if not self.local:
            self.local = signum
            log.warning("got %s: stopping after the step in progress, with a checkpoint",
                        signal.Signals(signum).name)

    def install(self) -> None:
        """Catch the stop signals (only the main thread can)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _collect(self) -> None:
        if self._work is not None:
            self._work.wait()
            self.agreed = self.agreed or int(self._buf[0])
            self._work = None

    def poll(self) -> bool:
        """Once per batch on every rank: True once every rank knows a stop was asked."""
        if self.group is None:
            self.agreed = self.agreed or self.local
            return bool(self.agreed)
        self._collect()
        if not self.agreed:
            self._buf = torch.tensor([self.local], dtype=torch.int64)
            self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group,
                                         async_op=True)
        return bool(self.agreed)

    def settle(self) -> int:
        """At a segment end (collective): the signal any rank got by now, or 0."""
        if self.group is None:
            self.agreed = self.agreed or self.local
            return self.agreed
        self._collect()
        flag = torch.tensor([self.local], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.agreed = self.agreed or int(flag[0])
        return self.agreed

    def until_stopped(self, batches: Iterable) -> Iterator:
        """``batches`` until every rank agreed to stop."""
        for batch in batches:
            if self.poll():
                return
            yield batch


def who_is_missing(rank: int, world_size: int, step: int, wait_s: float = 10.0
                   ) -> Optional[List[int]]:
    """After a collective timed out on this rank: the ranks that do not say within
    ``wait_s`` that they timed out too (through the process group's store), those stopped,
    hung or gone; None when the store does not answer (it lives in rank 0's process
    unless a launcher such as torchrun holds it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=wait_s))
        store.set(f"robe/timed_out/{rank}", str(step))
        keys = {r: f"robe/timed_out/{r}" for r in range(world_size)}
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r, k in keys.items() if not store.check([k])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except Exception as e:  # noqa: BLE001 - the store may be gone with a stopped rank 0
        log.warning("could not ask the store which ranks answer: %s", e)
        return None
