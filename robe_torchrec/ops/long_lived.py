"""Tensors the ops keep across calls, made where no CUDA graph memory pool can claim them.

The ops keep a few small device tensors from one call to the next: the reference hash's
block terms, the device copies of a layout (the unpooled lookup's keys layout, a CPU
``table_meta``'s copy) and the replay tally of the deferred checks. Each is made once, by
whichever call needs it first. When that call is a warm-up of
``torch.compile(mode="reduce-overhead")``, Inductor's CUDA graph trees route every
allocation of the calling thread to their private memory pool, and they later hand that
pool's memory back as their own bookkeeping says it is free: a tensor kept by the ops there
would be overwritten by a later graph. A pool takes the allocations of the thread it was
entered on (``torch.cuda.use_mem_pool`` documents it), so :func:`long_lived` makes the
tensor on a thread of its own and waits for it. That thread works on the caller's stream:
its work is ordered with the caller's, and the memory belongs to that stream, as if the
caller had allocated it. Elsewhere (a CPU) it just calls ``make``.

A thread's grad and inference modes are its own, so what it makes is a normal tensor even
when the caller runs under ``torch.inference_mode()``.

Example::

    >>> terms = long_lived(lambda: host_terms.to(device), device)
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, List, TypeVar

import torch

T = TypeVar("T")

#: the module of Inductor's CUDA graph trees (``torch.compile(mode="reduce-overhead")``)
_CUDA_GRAPH_TREES = "torch._inductor.cudagraph_trees"


def pools_may_claim(device: torch.device) -> bool:
    """Whether a device tensor an op keeps past its call may be memory of a CUDA graph
    pool it did not make: on CUDA once Inductor's CUDA graph trees are loaded, whose
    warm-ups and recordings allocate an op's inputs from their pool and refuse a kept one
    (told by their module being imported, which ``torch._dynamo.reset()`` does too where
    CUDA is present: cheap, and on the safe side)."""
    return device.type == "cuda" and _CUDA_GRAPH_TREES in sys.modules


def long_lived(make: Callable[[], T], device: torch.device) -> T:
    """``make()``, for tensors on ``device`` kept across calls: on CUDA run on a thread of
    its own (see the module docstring), with ``device`` and the caller's stream current;
    else here, outside inference mode."""
    if device.type != "cuda":
        with torch.inference_mode(False):
            return make()
    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(index)

    def on_device() -> T:
        with torch.cuda.device(index), torch.cuda.stream(caller):
            return make()

    return on_own_thread(on_device)


def on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a new thread, waited for; what it raises is raised here. A thread a
    call: the ops make a handful of tensors this way in a process, and a thread started
    for each leaves nothing behind that a fork could inherit."""
    made: List[T] = []
    failed: List[BaseException] = []

    def run() -> None:
        try:
            made.append(fn())
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="robe-long-lived")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]
