"""Run a function as every rank of a fresh local process group: for tests, benchmarks and the
pipeline comparison runner, which need clean processes (a process group, torch's thread
count and the pipelines' patched forwards are per process).

Example::

    >>> def step_times(rank, world_size, steps):   # module level: spawned processes import it
    ...     return [...]
    >>> per_rank = run_ranks(step_times, 2, 30)        # [rank 0's result, rank 1's result]

A rank's exception is re-raised here with its traceback. Results travel through a queue:
return plain Python or numpy values, not tensors (a tensor's shared memory dies with its
process).
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from robe_torchrec.distributed.process_group import (before_init_process_group,
                                                     destroy_process_group)


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, threads: Optional[int],
           fn: Callable, args, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        before_init_process_group()
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
              threads: Optional[int] = 1, timeout: float = 150.0) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes, each joined
    to a ``backend`` process group (``threads``: torch threads per process, None to leave
    torch's default); returns the results by rank, or raises ``RuntimeError`` with the first
    failing rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry,
                         args=(r, world_size, port, backend, threads, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    error = None
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                error = f"rank {rank}:\n{value}"
                break  # the other ranks may now hang in a collective
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if error else timeout)
            if p.is_alive():
                p.kill()
    if error:
        raise RuntimeError(error)
    return results
