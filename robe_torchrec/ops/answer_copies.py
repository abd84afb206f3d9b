"""The input checks' answers on their way to the host: several forwards' in one copy.

A deferred input check (:mod:`~robe_torchrec.ops.deferred_checks`) reads its four counts
on the host after the op has returned. Copying each forward's counts to pinned memory and
recording an event for them took two device calls a forward, on the host path that a GPU
forward of one id a bag waits on. The counts of forwards that one stream ran one after the
other sit in consecutive rows of one block (:mod:`~robe_torchrec.ops.count_rows`), so one
copy and one event carry the answers of up to ``answers_per_copy`` forwards
(:class:`~robe_torchrec.ops.tuning.TritonTuning`).

A copy goes out when that many answers have joined it, when its block has handed out its
last row, or when one of its answers must be read now (:meth:`AnswerCopy.read`: a wait
for every answer, or the bound on unread answers). Until it goes out its answers are not
ready: a problem is found at most that many forwards later, and a backward that cannot
wait for its forward's answer guards its writes with the counts on the device, as it does
while the device has not finished. Counts of their own (a ``torch.zeros``, where
``count_rows`` is not used) join no copy.

On CPU tensors the same bookkeeping runs with a plain copy and no event (how the tests
reach it).

Example::

    >>> counts = zeroed_counts(torch.device("cpu"))
    >>> copy, row = join(counts, answers_per_copy=8)
    >>> copy.ready()           # not sent: seven more answers may join it
    False
    >>> copy.read(row)         # sends it, waits for it, reads one answer
    [0, 0, 0, 0]
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

import torch

from robe_torchrec.ops import count_rows


class _BlockAnswers:
    """One block of count rows, its host mirror and the copy its next answers join."""

    def __init__(self, block: torch.Tensor):
        self.block = block
        # kept across calls: a normal tensor even when made under inference_mode, as later
        # calls copy into it
        with torch.inference_mode(False):
            self.host = torch.empty(block.shape, dtype=block.dtype, device="cpu",
                                    pin_memory=block.is_cuda)
        self.open: Optional[AnswerCopy] = None


class AnswerCopy:
    """Rows ``first`` to ``last`` of one block of count rows, copied to the host in one
    go on the stream their kernels ran on (rows in between that no answer joined are
    copied too: nothing reads them)."""

    def __init__(self, answers: _BlockAnswers):
        self._answers = answers
        block = answers.block
        self._stream = torch.cuda.current_stream(block.device) if block.is_cuda else None
        self.first, self.last, self.size = block.shape[0], -1, 0
        self.sent = False
        self._event: Optional["torch.cuda.Event"] = None
        #: the rows' counts as lists, once read (one ``tolist`` a copy, not one an answer)
        self._counts: Optional[List[List[int]]] = None

    def ready(self) -> bool:
        """Whether the answers are on the host: sent, and the device has run the copy
        (asked without waiting, until it says yes)."""
        if self._counts is None:
            if not self.sent or (self._event is not None and not self._event.query()):
                return False
            self._counts = self._answers.host[self.first:self.last + 1].tolist()
        return True

    def read(self, row: int) -> List[int]:
        """The counts of ``row``, sending the copy and waiting for it if it has not
        arrived."""
        if self._counts is None:
            with _lock:
                self._send()
            if self._event is not None:
                self._event.synchronize()
            self._counts = self._answers.host[self.first:self.last + 1].tolist()
        return self._counts[row - self.first]

    def _send(self) -> None:
        """Queue the copy (once; the caller holds ``_lock``). ``sent`` is set last: a
        thread asking :meth:`ready` without the lock must not see it before the event."""
        if self.sent:
            return
        answers = self._answers
        if answers.open is self:
            answers.open = None
        rows = slice(self.first, self.last + 1)
        if self._stream is None:
            answers.host[rows].copy_(answers.block[rows])
        else:
            with torch.cuda.stream(self._stream):
                answers.host[rows].copy_(answers.block[rows], non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        self.sent = True


#: id of a block of count rows -> its answers (the entry holds the block, so no other
#: object takes its id while it is here)
_blocks: Dict[int, _BlockAnswers] = {}
_LAST_ROW = count_rows.ROWS_PER_BLOCK - 1
#: blocks followed at once (a stream has one in use; beyond, every open copy goes out)
_MAX_BLOCKS = 8
#: copies are joined and sent by whichever thread runs a forward or reads an answer
_lock = threading.Lock()


def send_idle() -> None:
    """Send, without waiting, every open copy whose rows' stream is not the current one on
    its device: no forward on the current stream joins it, and one on its own stream may
    never come (a warm-up's stream under Inductor's CUDA graph trees, whose replays run
    nothing of ours on the host), so its answers would wait for a full read."""
    with _lock:
        for answers in list(_blocks.values()):
            copy = answers.open
            if copy is not None and copy._stream is not None and \
                    copy._stream != torch.cuda.current_stream(copy._stream.device):
                copy._send()


def join(counts: torch.Tensor, answers_per_copy: int) -> Optional[Tuple[AnswerCopy, int]]:
    """``(copy, row)``: the copy that will carry the answer ``counts`` will hold once its
    kernel has run (queued after that kernel), and the row to read; ``None`` for counts that
    are no row of a block (they need a copy of their own)."""
    position = count_rows.position(counts)
    if position is None:
        return None
    block, row = position
    with _lock:
        answers = _blocks.get(id(block))
        if answers is None:
            if len(_blocks) >= _MAX_BLOCKS:
                for stale in _blocks.values():
                    if stale.open is not None:
                        stale.open._send()
                _blocks.clear()
            answers = _blocks[id(block)] = _BlockAnswers(block)
        copy = answers.open
        if copy is None:
            copy = answers.open = AnswerCopy(answers)
        # rows taken one after the other may join in another order (threads)
        if row < copy.first:
            copy.first = row
        if row > copy.last:
            copy.last = row
        copy.size += 1
        last_row = row == _LAST_ROW
        if copy.size >= answers_per_copy or last_row:
            copy._send()
        if last_row:  # the block hands out no more rows
            del _blocks[id(block)]
    return copy, row
