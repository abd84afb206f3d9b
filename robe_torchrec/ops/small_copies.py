"""A few host integers on the device without making the host wait for it.

The per-call index tensors around the op (the unpooled lookup's bags, a VBE batch's padding)
start from integers the host already holds: counts and strides, a handful per feature. On
CUDA, ``torch.tensor(ints, device="cuda")`` copies them from pageable memory, and such a copy
first waits for the stream's earlier work: the host stops until the device has caught up,
every call. From pinned memory the copy is queued like a kernel; the caching host allocator
keeps the pinned block until the copy has run.

Example::

    >>> counts = ints_on_device([5, 0, 3], torch.int64, torch.device("cuda"))  # no wait
"""

from __future__ import annotations

from typing import List

import torch
from torch import Tensor


def ints_on_device(values: List[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``; on CUDA copied from pinned memory
    without a wait. Inside a CUDA graph capture, and in a graph ``torch.compile`` traces, the
    copy is the plain one: a capture refuses it with CUDA's error (a replay would read a
    pinned block reused since), and the compiler places it in its own graph."""
    if device.type != "cuda" or torch.compiler.is_compiling() or \
            torch.cuda.is_current_stream_capturing():
        return torch.tensor(values, dtype=dtype, device=device)
    return host_ints(values, dtype, pinned=True).to(device, non_blocking=True)


def host_ints(values: List[int], dtype: torch.dtype, pinned: bool) -> Tensor:
    """``values`` in host memory (``pinned``: page-locked), whatever the default device
    (``torch.set_default_device("cuda")`` would make a plain ``torch.tensor`` a CUDA tensor,
    copied from pageable memory, and one that cannot be pinned)."""
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=pinned)
