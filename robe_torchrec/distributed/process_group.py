"""Set-up and teardown of a process group that leave none of its threads to the interpreter's
shutdown.

A gloo group runs worker threads that hold the tensors of recent collectives. If the group
is still alive when Python shuts down, one of those threads may release such a tensor after
the interpreter has begun finalizing; taking the GIL then ends the thread, and the process
aborts with ``terminate called without an active exception`` (SIGABRT) after a run that
succeeded. Two things keep a group alive past ``destroy_process_group``:

- ``torch.distributed.nn``, ``torch.distributed.optim`` and FSDP's grad scaler take
  ``group.WORLD`` as a default argument, bound when the module is first imported. TorchRec
  and its optimizers import them, often only after the group exists.
- Reference cycles (a ``DistributedModelParallel``, a train pipeline) that hold the group
  until the garbage collector runs, which may be at shutdown.

Example::

    >>> before_init_process_group()
    >>> dist.init_process_group("gloo")
    >>> ...                                   # build, shard and train
    >>> destroy_process_group()               # the group's threads are joined here
"""

from __future__ import annotations

import gc
import importlib

import torch.distributed as dist

_BIND_WORLD_ON_IMPORT = ("torch.distributed.nn", "torch.distributed.optim",
                         "torch.distributed.fsdp.sharded_grad_scaler")


def before_init_process_group() -> None:
    """Import the modules that bind ``group.WORLD`` at import time, so that they bind None
    (call it before ``dist.init_process_group``)."""
    for name in _BIND_WORLD_ON_IMPORT:
        importlib.import_module(name)


def destroy_process_group() -> None:
    """Free the garbage that may hold the process groups, then destroy them all: with
    :func:`before_init_process_group` called first, their threads end here."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


__all__ = ["before_init_process_group", "destroy_process_group"]
