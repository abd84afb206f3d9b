"""Input checks whose answer is read after the op returns: how the Triton ops avoid waiting
for the GPU on every call.

The Triton ops reduce their data-dependent input checks (offsets, ids, per-sample weights) to
four counts on the device (counted by the forward kernel as it pools, else by
``_input_summary_kernel``). Reading the counts at once makes the
host wait for the GPU on every call, which stalls a host that would otherwise queue work
ahead (a train pipeline, or just the next layer). With deferred checks the op leaves its
counts to a copy to pinned host memory that carries the answers of several forwards at once
(:mod:`~robe_torchrec.ops.answer_copies`, ``tuned(answers_per_copy=...)``, 8 by default)
and returns; the answer is read later:

* at the start of any later Triton op, for every earlier check whose copy has gone out and
  whose counts the device has copied (no wait);
* by the backward ops, for the inputs the forward checked (the same ``values``, ``offsets``
  and per-sample weights, unchanged since), if that answer has reached the host: a
  problem raises before anything is written. If it has not, the backward does not wait:
  its kernels get the forward's counts on the device and write nothing (no gradient, no
  weight or optimizer-state change) when a count is not 0, and the problem raises at a
  later call. A backward given inputs no forward checked runs the summary kernel and
  guards its writes with that answer the same way. Either way bad input never changes a
  weight;
* by :func:`raise_pending_checks`, which waits for all of them;
* once more than :data:`MAX_PENDING` answers are unread, the oldest is waited for;
* when the process ends, where each problem found is printed to stderr.

A problem raises the message it raises at the call in immediate mode, with a note that the
call returned before it was found. The kernels never read or write outside their tensors on
bad input (offsets are clamped, hashed positions wrap into the array), so what a deferred call
computed from bad input is wrong but harmless, and the error still comes before any update.

Under CUDA graph capture nothing is read: the counts stay on the device, rewritten by every
replay, and the backward's kernels guard their writes with them as above. Every replay also
adds them to a sum per device whose pinned copy the host glances at, without waiting, in
:func:`raise_ready` (the start of a later Triton op, and a fused optimizer's ``step()``,
which TorchRec's train loops call every iteration); :func:`raise_pending_checks` waits and
reads them (:func:`captured_checks` lists them).

Deferred checks are on for CUDA tensors and off for CPU tensors (Triton's interpreter, where
reading the counts costs nothing). ``ROBE_DEFER_CHECKS=0`` turns them off everywhere (every
error at its call, one wait per op), ``=1`` on everywhere; :func:`defer_checks` sets it for a
block.

Example::

    >>> with defer_checks(True):
    ...     out = torch.ops.robe.forward(weights, bad_values, offsets, ...)  # returns
    ...     raise_pending_checks()      # DeferredCheckError: robe: id 7 at position 3 of feature 0 ...
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import weakref
from typing import Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch

from robe_torchrec.ops import answer_copies, count_rows
from robe_torchrec.ops.feature_names import with_names
from robe_torchrec.ops.long_lived import long_lived, pools_may_claim
from robe_torchrec.ops.tuning import current as current_tuning
from robe_torchrec.ops.validation import IdCheck, check_data
from robe_torchrec.ops.weak_ids import WeakIdDict

#: unread answers allowed before the oldest is waited for (bounds the inputs kept alive)
MAX_PENDING = 16

_ENV = "ROBE_DEFER_CHECKS"


class DeferredCheckError(ValueError):
    """Bad input found by a deferred check: raised by a later call than the one that took
    the input (its message is that call's, with a note saying so)."""


def _setting_from_env() -> Optional[bool]:
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"robe: {_ENV}={value!r}; expected 1 (defer the input checks), "
                     "0 (check at every call) or auto (defer on CUDA)")


_setting: Optional[bool] = _setting_from_env()


@contextlib.contextmanager
def defer_checks(enabled: bool) -> Iterator[None]:
    """Defer the Triton ops' data checks (``True``) or read them at every call (``False``)
    inside the block, on every device. Answers still unread when the block ends stay queued."""
    global _setting
    previous, _setting = _setting, bool(enabled)
    try:
        yield
    finally:
        _setting = previous


def deferred_for(device: torch.device) -> bool:
    """Whether checks on ``device`` are deferred now: always inside a CUDA graph capture,
    which a read of the answer at the call would invalidate (what the capture records is
    read after its replays, :func:`raise_pending_checks`)."""
    if _setting is None:
        return device.type == "cuda"
    return _setting or (device.type == "cuda" and is_capturing())


@dataclasses.dataclass(slots=True)
class _Pending:
    """One summary's counts on their way to the host, and the inputs it checked (kept until
    the counts are read, to name the first problem). The counts travel in an answer copy
    shared with other forwards (``copy``, ``row``), or on their own (``counts``, ``event``:
    counts that are no row of a block, see :mod:`~robe_torchrec.ops.answer_copies`)."""
    counts: Optional[torch.Tensor]
    event: Optional["torch.cuda.Event"]
    inputs: Optional[Tuple]
    versions: Tuple[int, ...]
    clean: Optional[bool] = None
    error: str = ""
    #: the pool the pinned counts and their event go back to once read (CUDA only)
    slot_key: Optional[tuple] = None
    #: the counts on the device until read: a backward that cannot wait for the answer
    #: hands them to its kernels, which then write nothing if a count is not 0
    device_counts: Optional[torch.Tensor] = None
    #: recorded in a CUDA graph: the counts are meaningful only after a replay
    captured: bool = False
    copy: Optional[answer_copies.AnswerCopy] = None
    row: int = 0
    #: the stream the counts were written on (:func:`~robe_torchrec.ops.count_rows.stream_of`)
    stream: int = 0

    def done(self) -> bool:
        if self.captured:
            return False
        if self.clean is not None:
            return True
        if self.copy is not None:
            return self.copy.ready()
        return self.event is None or self.event.query()

    def guard(self) -> Optional[torch.Tensor]:
        """The answer for a backward that must not wait: ``None`` when the inputs are known
        to pass (a problem raises), else the counts on the device (answer not read yet)."""
        with _resolving:  # not half resolved by another thread
            if self.clean is None and not is_capturing() and self.done():
                self.resolve()
            if self.clean is None:
                _read_on_current_stream(self.device_counts, self.stream)
                return self.device_counts
        self.resolve()  # raises if the inputs were found bad
        return None

    def resolve(self) -> None:
        """Wait for the counts if needed; raise the first problem's message if any (again
        on every later call: a backward must not take inputs already found bad). One
        thread at a time: a backward on autograd's device thread may resolve the answer a
        forward on another thread resolves too."""
        with _resolving:
            if self.clean is None:
                if self.copy is not None:
                    counts, self.copy = self.copy.read(self.row), None
                else:
                    if self.event is not None:
                        self.event.synchronize()
                    counts = self.counts.tolist()
                inputs, self.inputs = self.inputs, None
                self.device_counts = None
                if self.slot_key is not None:  # read: the next deferred check may reuse them
                    _spare_slots[self.slot_key].append((self.counts, self.event))
                    self.counts, self.event = None, None
                self.clean = not any(counts)
                if not self.clean:
                    self.error = _problem_message(counts, inputs, self.versions)
        if not self.clean:
            raise DeferredCheckError(self.error)


def _read_on_current_stream(counts: Optional[torch.Tensor], stream: int) -> None:
    """Counts written on ``stream`` that a kernel on the current stream will read (a
    backward run on another stream than its forward): the allocator must not hand their
    memory out again before that read, as it would once the answer is read and the counts
    dropped (``record_stream``). Not inside a capture, which orders its own streams."""
    if counts is None or not counts.is_cuda or is_capturing():
        return
    if count_rows.stream_of(counts.device) != stream:
        counts.record_stream(torch.cuda.current_stream(counts.device))


@dataclasses.dataclass(slots=True)
class _Record:
    """What a forward checked, for the backward ops that get the same inputs."""
    offsets: "weakref.ref[torch.Tensor]"
    per_sample_weights: Optional["weakref.ref[torch.Tensor]"]
    versions: Tuple[int, ...]
    #: the checked CPU copy of table_meta (one object per tensor version and arguments)
    meta_cpu: torch.Tensor
    id_check: IdCheck
    pending: _Pending


_pending: Deque[_Pending] = collections.deque()
#: held to take an answer off the queue and to resolve one (threads share them)
_resolving = threading.RLock()
#: values tensor -> the last check of it (weak keys: a record never keeps its inputs alive)
_records: WeakIdDict = WeakIdDict()


def _versions(values: torch.Tensor, offsets: torch.Tensor,
              per_sample_weights: Optional[torch.Tensor]) -> Optional[Tuple[int, ...]]:
    # spelled out rather than a generator over the three: this runs at every forward
    try:
        return (values._version, offsets._version,
                -1 if per_sample_weights is None else per_sample_weights._version)
    except RuntimeError:  # inference tensors carry no version: nothing can be matched later
        return None


def submit(problems: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
           per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
           meta_cpu: torch.Tensor, id_check: IdCheck) -> None:
    """Queue the answer of a summary (``problems``: its four counts, on the device) for a
    later read, and remember what it checked."""
    versions = _versions(values, offsets, per_sample_weights)
    if is_capturing():
        _submit_captured(problems, values, offsets, per_sample_weights, table_meta, meta_cpu,
                         id_check, versions)
        return
    # the inputs, to name a problem, unless they may be a CUDA graph pool's (then the
    # problem is told by its counts)
    inputs = (None if pools_may_claim(problems.device) else
              (values, offsets, per_sample_weights, table_meta, meta_cpu, id_check))
    if problems.is_cuda:
        # the device's first deferred check, outside any capture: make its replay tally too
        prepare_tally(problems)
    per_copy = current_tuning().answers_per_copy
    joined = answer_copies.join(problems, per_copy) if per_copy > 1 else None
    stream = count_rows.stream_of(problems.device) if problems.is_cuda else 0
    if joined is not None:
        pending = _Pending(None, None, inputs, versions or (), device_counts=problems,
                           copy=joined[0], row=joined[1], stream=stream)
    elif problems.is_cuda:
        slot_key = (problems.device, problems.shape, problems.dtype)
        counts, event = _slot(slot_key)
        counts.copy_(problems, non_blocking=True)
        event.record(torch.cuda.current_stream(problems.device))
        pending = _Pending(counts, event, inputs, versions or (), slot_key=slot_key,
                           device_counts=problems, stream=stream)
    else:
        pending = _Pending(problems, None, inputs, versions or (), device_counts=problems)
    _pending.append(pending)
    _remember(values, offsets, per_sample_weights, versions, meta_cpu, id_check, pending)
    while len(_pending) > MAX_PENDING:
        _resolve_oldest()


#: pinned host buffers for counts of their own and their events, back from answers already
#: read, by (device, shape, dtype): a deferred check reuses one instead of allocating new
#: ones, host work a GPU forward waits on at small batches
_spare_slots: Dict[tuple, List[Tuple[torch.Tensor, "torch.cuda.Event"]]] = \
    collections.defaultdict(list)


def _slot(key: tuple) -> Tuple[torch.Tensor, "torch.cuda.Event"]:
    spares = _spare_slots[key]
    if spares:
        return spares.pop()
    _, shape, dtype = key
    with torch.inference_mode(False):  # reused by later calls, which copy into it
        return (torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True),
                torch.cuda.Event())


#: the answer of every check read at the call that passed
_PASSED = _Pending(torch.zeros(0), None, None, (), clean=True)


def remember_clean(values: torch.Tensor, offsets: torch.Tensor,
                   per_sample_weights: Optional[torch.Tensor], meta_cpu: torch.Tensor,
                   id_check: IdCheck) -> None:
    """Record inputs whose checks passed at the call (checks not deferred), so that the
    backward ops of the same inputs need not check them again."""
    _remember(values, offsets, per_sample_weights,
              _versions(values, offsets, per_sample_weights), meta_cpu, id_check, _PASSED)


def _remember(values: torch.Tensor, offsets: torch.Tensor,
              per_sample_weights: Optional[torch.Tensor], versions: Optional[Tuple[int, ...]],
              meta_cpu: torch.Tensor, id_check: IdCheck, pending: _Pending) -> None:
    if versions is not None:
        psw = None if per_sample_weights is None else weakref.ref(per_sample_weights)
        _records[values] = _Record(weakref.ref(offsets), psw, versions, meta_cpu, id_check,
                                   pending)


def raise_ready(send_idle: bool = False) -> None:
    """Read every queued answer the device has finished, oldest first (no wait); raise the
    first problem found. ``send_idle`` (an optimizer's step, once a training step): first
    send the answer copies of streams no forward runs on now
    (:func:`~robe_torchrec.ops.answer_copies.send_idle`), so that a later read finds them.
    Does nothing while a CUDA graph is being captured (an event query would end the
    capture)."""
    if is_capturing():
        return
    if send_idle:
        answer_copies.send_idle()
    while _pending and _resolve_oldest(ready_only=True):
        pass
    if _graphs_checked:
        _read_replays(wait=False)


def _resolve_oldest(ready_only: bool = False) -> bool:
    """Take the oldest queued answer (``ready_only``: if the device has finished it) and
    resolve it; whether there was one to take. Taken under a lock: threads share the
    queue."""
    with _resolving:  # (held while resolving: another thread's read waits for this one)
        if not _pending or (ready_only and not _pending[0].done()):
            return False
        _pending.popleft().resolve()
    return True


def raise_pending_checks() -> None:
    """Wait for every queued answer and raise the first problem found; after it returns,
    every input a Triton op has taken so far passed its checks. It also reads the checks
    recorded in CUDA graphs, those of every replay since the last read: call it after a
    replay. Not inside a CUDA graph capture, where nothing may wait for the device."""
    if is_capturing():
        raise RuntimeError(
            "robe: raise_pending_checks waits for the device, which a CUDA graph capture "
            "does not allow: call it after the capture (and after a replay, to read what the "
            "replay's checks found)")
    while _resolve_oldest():
        pass
    if _graphs_checked:  # reading a graph's counts waits for the device
        _read_replays(wait=True)


def _report_unread_at_exit() -> None:
    """Read every answer still unread when the process ends and print each problem found
    to stderr: a script that never calls :func:`raise_pending_checks` (or whose last calls
    left their answers unread) would otherwise never hear of them. Nothing can raise at
    exit, so the exit status stays what it was. A child forked from the process that
    queued the answers reads none (its copy of the queue is the parent's, and CUDA cannot
    be used after a fork)."""
    if os.getpid() != _PID:
        return
    found = []
    try:
        while _pending:
            try:
                _pending.popleft().resolve()
            except DeferredCheckError as exc:
                found.append(str(exc))
        if _graphs_checked and not is_capturing():
            try:
                _read_replays(wait=True)
            except DeferredCheckError as exc:
                found.append(str(exc))
    except Exception as exc:  # noqa: BLE001  e.g. the device is gone by now: say so
        found.append(f"robe: the input checks still unread could not be read ({exc})")
    for message in found:
        print(f"robe: an input check unread when the process ended found a problem: "
              f"{message}", file=sys.stderr)


_PID = os.getpid()
atexit.register(_report_unread_at_exit)


# --- checks recorded in a CUDA graph -------------------------------------------------------

def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (then nothing may wait for the
    device, query an event or copy to pageable host memory)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass
class CapturedCheck:
    """An input check recorded in a CUDA graph: its counts live on the device, rewritten by
    every replay, and are read by :meth:`read` (or :func:`raise_pending_checks`) after a
    replay. Before the graph's first replay they hold nothing meaningful. ``slot``: the
    entry of its device's replay tally that each of its replays adds one to (``None``: the
    device had no tally when it was recorded)."""
    counts: torch.Tensor
    inputs: Tuple
    slot: Optional[int] = None

    def read(self) -> None:
        """Raise the first problem the last replay's inputs had (waits for the device)."""
        message = self.problem()
        if message is not None:
            raise DeferredCheckError(message)

    def problem(self) -> Optional[str]:
        """The message of the last replay's first problem, or ``None`` (waits for the
        device). Nothing is written: the counts are also the guard of that replay's
        backward, which may not have run yet."""
        counts = self.counts.tolist()
        if not any(counts):
            return None
        values, offsets, per_sample_weights = self.inputs[:3]
        versions = _versions(values, offsets, per_sample_weights) or ()
        return _problem_message(counts, self.inputs, versions)


#: the checks recorded in CUDA graphs, newest last (bounded: a graph that is gone leaves
#: its entry until newer captures push it out)
_captured: Deque[CapturedCheck] = collections.deque(maxlen=MAX_PENDING)
#: some check was recorded in a CUDA graph: its replays' counts are to be read (kept in
#: :data:`_captured`, or, where a graph pool may claim them, in the replay tally alone)
_graphs_checked = False


def captured_checks() -> List[CapturedCheck]:
    """The input checks recorded in CUDA graphs so far (newest last)."""
    return list(_captured)


#: replay counters a device's tally keeps, one a recorded check (reused after that many)
REPLAY_SLOTS = 1024
_next_slot = itertools.count()


@dataclasses.dataclass
class _ReplayTally:
    """Every captured check's counts on one device, summed over every replay since the last
    read. A replay rewrites its own counts, so a read after two replays would miss a problem
    of the first: each captured forward also adds its counts to ``device`` (an add recorded
    in the graph) and copies the sum to ``host`` (pinned, a copy recorded too), which the
    host polls without waiting. Each recorded check also adds one to its own entry of
    ``replays`` at every replay, so that a read names only checks replayed since the last
    one (an old graph's counts still hold the problem it was named for, and a graph not
    replayed yet holds whatever its memory held). Made by the first deferred check on the
    device, outside any capture (a capture cannot allocate it: the graph would zero it at
    every replay); a warm-up call, which capture needs anyway, makes it."""
    device: torch.Tensor
    host: torch.Tensor
    replays: torch.Tensor
    #: ``replays`` as the last read found them
    seen: List[int] = dataclasses.field(default_factory=lambda: [0] * REPLAY_SLOTS)

    def take(self) -> Tuple[List[int], set]:
        """The sum so far and the slots replayed since the last read, waiting for the
        replays in flight; then start again from 0."""
        _wait_for(self.device.device)
        counts = self.host.tolist()
        now = self.replays.tolist()
        replayed = {slot for slot, (a, b) in enumerate(zip(now, self.seen)) if a != b}
        self.seen = now
        self.device.zero_()
        self.host.zero_()
        return counts, replayed


_tallies: Dict[torch.device, _ReplayTally] = {}


def prepare_tally(like: torch.Tensor) -> None:
    """Make the replay tally of ``like``'s device (counts of its shape and dtype), if none:
    at a check outside any capture, deferred or not, so that a later capture finds it."""
    if like.device not in _tallies:
        # kept for every later call to add to: made outside any CUDA graph pool
        _tallies[like.device] = long_lived(lambda: _ReplayTally(
            torch.zeros_like(like),
            torch.zeros(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda),
            torch.zeros(REPLAY_SLOTS, dtype=torch.int64, device=like.device)), like.device)


def _wait_for(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read_replays(wait: bool) -> None:
    """Raise what the checks recorded in CUDA graphs found. Without ``wait``, only when a
    replay's problem already reached the host (a glance at the pinned sums, no wait for the
    device); with it, in any case. The last replay's problem is named from its inputs
    (:meth:`CapturedCheck.problem`), the newest graph's first, of the graphs replayed since
    the last read; an earlier replay's by its counts. One thread at a time takes the
    tallies (the glance, at the start of every op once a graph was captured, takes no
    lock: a thread that finds them taken meanwhile reads zeros and raises nothing)."""
    if not wait and not any(any(t.host.tolist()) for t in list(_tallies.values())):
        return
    with _resolving:
        taken = {device: tally.take() for device, tally in list(_tallies.items())}
        totals = [sum(c) for c in zip(*(counts for counts, _ in taken.values()))]
        named = []
        for check in reversed(list(_captured)):
            tallied = taken.get(check.counts.device)
            if check.slot is not None and tallied is not None:
                counts, replayed = tallied
                # read if a replay on its device had a problem, and it was replayed since
                if not any(counts) or check.slot not in replayed:
                    continue
            elif tallied is not None and not any(totals):
                continue  # no tally counts its replays: read it when any problem shows
            message = check.problem()
            if message is not None:
                named.append(message)
    if named:
        others = (f" (and the inputs of {len(named) - 1} more CUDA graph(s) had problems "
                  "too)" if len(named) > 1 else "")
        raise DeferredCheckError(named[0] + others)
    if any(totals):
        found = ", ".join(f"{n} {what}" for n, what in zip(totals, _PROBLEMS) if n)
        raise DeferredCheckError(
            f"robe: CUDA graph replays since the last read took input with {found}; a "
            "backward of that input wrote nothing, and the input is gone, so the problem "
            "cannot be named here: run those batches without the graph to name it (found by "
            "the checks recorded in a CUDA graph)")


def _submit_captured(problems: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                     per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                     meta_cpu: torch.Tensor, id_check: IdCheck,
                     versions: Optional[Tuple[int, ...]]) -> None:
    """Record the check in the graph being captured: its counts added to the replay tally
    by the graph. Unless a CUDA graph pool may claim them (Inductor's CUDA graph trees,
    which refuse a pool tensor kept past a recording and reuse memory no output holds),
    also keep the counts and inputs to name the last replay's problem, and let the backward
    of the same replay guard its writes with these counts; else the tally alone tells a
    problem, and a backward checks its inputs in its own graph."""
    global _graphs_checked
    _graphs_checked = True
    tally = _tallies.get(problems.device)
    if tally is not None and tally.device.shape != problems.shape:
        tally = None
    if tally is not None:
        tally.device.add_(problems)
        tally.host.copy_(tally.device, non_blocking=True)
    if recorded_guard(problems.device) is not None:  # (raises without a tally)
        return
    slot = None
    if tally is not None:
        slot = next(_next_slot) % REPLAY_SLOTS
        tally.replays[slot].add_(1)  # recorded in the graph, as the sum's add
    check = CapturedCheck(problems, (values, offsets, per_sample_weights, table_meta, meta_cpu,
                                     id_check), slot)
    _captured.append(check)
    # the backward of the same replay guards its writes with these very counts
    pending = _Pending(problems, None, None, versions or (), device_counts=problems,
                       captured=True)
    _remember(values, offsets, per_sample_weights, versions, meta_cpu, id_check, pending)


def recorded_guard(device: torch.device) -> Optional[torch.Tensor]:
    """Inside a capture where a CUDA graph pool may claim the counts (Inductor's CUDA graph
    trees), the guard of a recorded backward: the replay tally's counts on the device, to
    which the forward's replay has added its own by the time the backward's replay reads
    them (a problem in any replay since the last read then stops every write, until the
    host reads it and raises). ``None`` elsewhere."""
    if not pools_may_claim(device):
        return None
    tally = _tallies.get(device)
    if tally is None:
        raise RuntimeError(
            "robe: an input check is being recorded in a CUDA graph under torch.compile's "
            "CUDA graph trees before any call on this device outside a graph made its "
            "replay tally; run one eager call on the device first")
    return tally.device


def earlier_check(values: torch.Tensor, offsets: torch.Tensor,
                  per_sample_weights: Optional[torch.Tensor], meta_cpu: torch.Tensor,
                  id_check: IdCheck) -> Optional[_Pending]:
    """The answer of an earlier call that checked these very inputs against the same
    ``table_meta`` (``meta_cpu`` is one object per tensor version), unchanged since, with a
    check at least as strict as ``id_check``; ``None`` if there was none. Nothing is read:
    see :meth:`_Pending.guard`."""
    record = _records.get(values)
    if record is None or record.offsets() is not offsets or record.meta_cpu is not meta_cpu:
        return None
    now = _versions(values, offsets, per_sample_weights)
    if now is None or now[:2] != record.versions[:2]:
        return None
    # a call without per-sample weights (their gradient's) needs none of their checks
    if per_sample_weights is not None and (
            record.per_sample_weights is None
            or record.per_sample_weights() is not per_sample_weights
            or now[2] != record.versions[2]):
        return None
    if not _covers(record.id_check, id_check):
        return None
    return record.pending


def _covers(done: IdCheck, wanted: IdCheck) -> bool:
    """Whether passing ``done`` implies passing ``wanted``."""
    return (done == wanted or (not wanted.in_bounds and wanted.key_limit is None)
            or (done.in_bounds and wanted.implied_by_bounds))


#: values tensor -> what names a problem found in it instead of the op's own checks
_NAMERS: WeakIdDict = WeakIdDict()


def name_problems_with(values: torch.Tensor, namer: Callable[[], None]) -> None:
    """Have a problem a deferred check finds in ``values`` named by ``namer``, which raises
    ``ValueError`` with the message, or returns when it cannot name it (what it reads has
    changed since): for values made from other inputs, whose own check gives the message
    that means something to the caller (the unpooled lookup's keys, made from ids; see
    :mod:`~robe_torchrec.ops.unpooled`). Unnamed, the problem is told by its counts."""
    _NAMERS[values] = namer


_PROBLEMS = ("bags with decreasing offsets", "ids that fail their check",
             "non-finite per-sample weights", "offsets that do not start at 0 or end at "
             "len(values)")
_NOTE = ("(found by a deferred input check, after the call that took this input returned; "
         f"set {_ENV}=0 to raise at the call)")


def _problem_message(counts: List[int], inputs: Optional[Tuple],
                     versions: Tuple[int, ...]) -> str:
    found = ", ".join(f"{n} {what}" for n, what in zip(counts, _PROBLEMS) if n)
    if inputs is None:  # not kept: they may have been a CUDA graph pool's
        return (f"robe: an earlier call's input had {found}; under torch.compile's CUDA "
                "graphs the ops keep no input to name it by: run that batch without them "
                f"(or with {_ENV}=0) to name it {_NOTE}")
    values, offsets, per_sample_weights, table_meta, meta_cpu, id_check = inputs
    namer = _NAMERS.get(values)
    if namer is not None:  # (it says itself whether what it reads has changed)
        try:
            namer()
        except ValueError as exc:
            return f"{exc} {_NOTE}"
    elif _versions(values, offsets, per_sample_weights) == versions:
        try:
            check_data(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check)
        except ValueError as exc:
            return f"{with_names(str(exc), table_meta)} {_NOTE}"
    # the inputs changed in place since (or hold no version): say what the counts say
    return (f"robe: an earlier call's input had {found}; it changed before the problem "
            f"could be named {_NOTE}")
