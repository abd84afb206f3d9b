"""Zeroed rows for the input checks' four problem counts, handed out without a device call.

Every Triton forward whose kernel counts its input's problems needs four zeroed int64 counts
of its own (the kernel adds to them, and a backward may read them later as its guard, see
:mod:`robe_torchrec.ops.deferred_checks`). ``torch.zeros(4)`` per call costs an allocation
and, on CUDA, a fill kernel's launch: on a GPU's host, host time that a forward of one id a
bag waits on. Here a whole block of rows is zeroed at once and each row is handed out once,
never zeroed again or reused: a row is as fresh as a ``torch.zeros(4)`` of its own, and the
block's memory goes back to the allocator when the last row is dropped.

A block serves only the stream it was zeroed on (one block at a time for each device and
stream), so that every kernel adding to a row runs after the fill, as stream order
guarantees for ``torch.zeros`` too.

A CUDA graph capture takes ``torch.zeros(4)`` instead (:func:`usable`): its replays must
zero their counts again. A block is made where no CUDA graph memory pool can claim it
(:func:`~robe_torchrec.ops.long_lived.long_lived`), so rows serve the warm-ups of
``torch.compile(mode="reduce-overhead")`` too: Inductor's CUDA graph trees route a warm-up's
allocations to their private pool and hand that memory back later as their bookkeeping says
it is free, and they refuse (``slow_path_cudagraph_asserts``) a pool tensor kept past a
warm-up, which a deferred check keeps its counts for.

Example::

    >>> counts = zeroed_counts(torch.device("cpu"))
    >>> counts.tolist(), zeroed_counts(torch.device("cpu")).data_ptr() != counts.data_ptr()
    ([0, 0, 0, 0], True)
"""

from __future__ import annotations

import itertools
from typing import Dict, Optional, Tuple

import torch

from robe_torchrec.ops.long_lived import long_lived

#: counts of a row (the kernels' four problem kinds, see ``deferred_checks._PROBLEMS``)
COUNTS = 4
#: rows zeroed at once: one fill for this many forwards (8 KiB)
ROWS_PER_BLOCK = 256


class _Block:
    """Rows of one zeroed ``[ROWS_PER_BLOCK, COUNTS]`` tensor, each handed out once; safe to
    share between threads (the counter is atomic under the GIL)."""

    def __init__(self, device: torch.device):
        # kept across calls, outside any CUDA graph pool; a normal tensor even when made
        # under inference_mode (an evaluation), as the training calls after it write it
        self._rows = long_lived(lambda: torch.zeros(ROWS_PER_BLOCK, COUNTS, dtype=torch.int64,
                                                    device=device), device).unbind(0)
        self._taken = itertools.count()

    def take(self) -> Optional[torch.Tensor]:
        i = next(self._taken)
        return self._rows[i] if i < ROWS_PER_BLOCK else None


#: (device, stream) -> the block its rows come from now
_blocks: Dict[Tuple[torch.device, int], _Block] = {}
#: blocks kept for their streams before starting over (rows already handed out keep theirs)
_MAX_BLOCKS = 64


def stream_of(device: torch.device) -> int:
    """The device's current stream, as an int (0 for a CPU; ``device`` has an index on
    CUDA)."""
    if device.type != "cuda":
        return 0
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:  # what Inductor's generated code calls; a Stream object is slower
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def usable(device: torch.device) -> bool:
    """Whether a launch on ``device`` may take its counts from a block (see the module's
    docstring): not under a CUDA graph capture."""
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def zeroed_counts(device: torch.device) -> torch.Tensor:
    """Four zeroed int64 counts on ``device`` for one kernel launch on its current stream,
    never handed out before. Only where :func:`usable` says so."""
    if device.type == "cuda" and device.index is None:
        # torch.device("cuda") is the current one: one block key with "cuda:N", and an index
        # for the raw stream query, which refuses None
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, stream_of(device))
    while True:
        block = _blocks.get(key)
        row = None if block is None else block.take()
        if row is not None:
            return row
        # another thread may empty the new block before this one takes from it: try again
        if len(_blocks) >= _MAX_BLOCKS:  # streams come and go (external ones): start over
            _blocks.clear()
        _blocks[key] = _Block(device)


def position(counts: torch.Tensor) -> Optional[Tuple[torch.Tensor, int]]:
    """``(block, index)``: the ``[ROWS_PER_BLOCK, COUNTS]`` tensor a row of
    :func:`zeroed_counts` was handed out from, and the row's index in it; ``None`` for counts
    of their own (a ``torch.zeros``). Rows one stream took one after the other sit one after
    the other in their block, so their answers can be copied to the host in one go."""
    block = counts._base
    if block is None or block.shape != _BLOCK_SHAPE:
        return None
    return block, (counts.storage_offset() - block.storage_offset()) // COUNTS


_BLOCK_SHAPE = (ROWS_PER_BLOCK, COUNTS)
