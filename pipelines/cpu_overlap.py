"""Run one piece of pipeline work on a worker thread while the caller does another.

On CPU there are no streams, so TorchRec's "lookup on a side stream while the optimizer
runs" has no effect. Torch ops release the GIL, so a worker thread can run the next
batch's embedding lookup while the main thread runs the dense optimizer step. Whether
that wins depends on free cores (see ``pipelines/results/compare_cpu.md``); it is an
option of :class:`pipelines.FusedSparseDistPipeline` (``cpu_overlap=True``), off by default.

Rules the callers keep: the two pieces touch disjoint parameters (the guards make sure the
dense optimizer never updates an embedding), and only the worker issues collectives
between ``submit`` and ``join`` (gloo requires every rank to issue them in the same order).

Example::

    >>> worker = OverlapWorker()
    >>> worker.submit(lambda: start_lookup(next_batch))
    >>> optimizer.step()  # on this thread, meanwhile
    >>> worker.join()     # re-raises the worker's exception, if any
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch


class OverlapWorker:
    """A single worker thread; at most one task in flight."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None

    def submit(self, fn: Callable[[], None]) -> None:
        if self._pending is not None:
            raise RuntimeError("OverlapWorker: join() the previous task first")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="robe-lookup")
        grad_enabled = torch.is_grad_enabled()  # thread-local: carry the caller's mode over

        def task() -> None:
            with torch.set_grad_enabled(grad_enabled):
                fn()

        self._pending = self._pool.submit(task)

    def join(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
