"""Zeroed rows for the input checks' counts (``robe_torchrec/ops/count_rows.py``): each row
is zero when handed out and handed out once, whatever was written to the rows before it,
and a stream never gets a row zeroed on another."""

import doctest
import sys
import threading
import types

import torch

from robe_torchrec.ops import count_rows
from robe_torchrec.ops import triton_kernels as tk
from robe_torchrec.ops.count_rows import ROWS_PER_BLOCK, zeroed_counts

CPU = torch.device("cpu")


def test_every_row_is_zero_and_new_across_blocks():
    taken = [zeroed_counts(CPU) for _ in range(2 * ROWS_PER_BLOCK + 3)]
    for row in taken:
        assert row.tolist() == [0, 0, 0, 0] and row.dtype == torch.int64
        row.fill_(7)  # what a kernel that found problems leaves
    assert len({row.data_ptr() for row in taken}) == len(taken)
    assert all(zeroed_counts(CPU).tolist() == [0] * 4 for _ in range(ROWS_PER_BLOCK + 1))


def test_rows_keep_the_pointer_alignment_a_launch_specialises_on():
    """Triton compiles a variant per pointer alignment (16 bytes or not): every row must be
    16-byte aligned, as a ``torch.zeros(4)`` of its own is, or a launch would compile anew."""
    assert all(zeroed_counts(CPU).data_ptr() % 16 == 0 for _ in range(ROWS_PER_BLOCK + 1))


def test_each_stream_takes_rows_from_its_own_block(monkeypatch):
    stream = [1]
    monkeypatch.setattr(count_rows, "stream_of", lambda device: stream[0])
    first = zeroed_counts(CPU)
    stream[0] = 2
    second = zeroed_counts(CPU)
    assert first._base is not second._base  # blocks zeroed for each stream
    stream[0] = 1
    assert zeroed_counts(CPU)._base is first._base


def test_blocks_of_streams_gone_are_let_go(monkeypatch):
    """A process that makes stream after stream (external ones) keeps a bounded number of
    blocks; a row handed out keeps its own block alive, so it stays valid."""
    stream = [0]
    monkeypatch.setattr(count_rows, "stream_of", lambda device: stream[0])
    monkeypatch.setattr(count_rows, "_blocks", {})
    first = zeroed_counts(CPU)
    for stream[0] in range(1, 3 * count_rows._MAX_BLOCKS):
        zeroed_counts(CPU)
    assert len(count_rows._blocks) <= count_rows._MAX_BLOCKS
    assert first.tolist() == [0] * 4


def test_threads_never_share_a_row():
    rows, start = [[], []], threading.Barrier(2)

    def take(mine):
        start.wait()
        mine.extend(zeroed_counts(CPU) for _ in range(3 * ROWS_PER_BLOCK))

    threads = [threading.Thread(target=take, args=(r,)) for r in rows]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pointers = [row.data_ptr() for mine in rows for row in mine]
    assert len(set(pointers)) == len(pointers) == 6 * ROWS_PER_BLOCK


def test_a_new_block_emptied_by_another_thread_first_is_replaced(monkeypatch):
    """Between making a block and taking its first row, other threads may take every row of
    it (seen in test_threads_never_share_a_row, once in a few hundred runs): the taker makes
    another block rather than return no row."""
    made = []

    class DrainedFirst(count_rows._Block):
        def __init__(self, device):
            super().__init__(device)
            made.append(self)
            if len(made) == 1:
                for _ in range(ROWS_PER_BLOCK):
                    self.take()

    monkeypatch.setattr(count_rows, "_Block", DrainedFirst)
    monkeypatch.setattr(count_rows, "_blocks", {})
    row = zeroed_counts(CPU)
    assert row is not None and row.tolist() == [0] * 4 and len(made) == 2


def test_cuda_takes_rows_outside_captures_with_or_without_graph_trees(monkeypatch):
    """A capture's replays must zero their counts again: ``torch.zeros`` there. Elsewhere
    rows, Inductor's CUDA graph trees loaded or not: a block is made outside any CUDA graph
    pool (``long_lived``), so a warm-up that keeps a row keeps no pool memory. (No CUDA call
    is made: ``usable`` reads the device type and the capture state.)"""
    cuda = torch.device("cuda", 0)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    assert count_rows.usable(cuda) and count_rows.usable(CPU)
    capturing[0] = True
    assert not count_rows.usable(cuda) and count_rows.usable(CPU)
    capturing[0] = False
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", types.ModuleType("t"))
    assert count_rows.usable(cuda) and count_rows.usable(CPU)


def test_a_block_is_made_outside_any_cuda_graph_pool(monkeypatch):
    made = []
    monkeypatch.setattr(count_rows, "long_lived",
                        lambda make, device: made.append(device) or make())
    monkeypatch.setattr(count_rows, "_blocks", {})
    assert zeroed_counts(CPU).tolist() == [0] * 4 and made == [CPU]


def test_a_launch_takes_torch_zeros_where_rows_will_not_do(monkeypatch):
    monkeypatch.setattr(count_rows, "usable", lambda device: False)
    counts = tk._check_counts(CPU)
    assert counts._base is None and counts.tolist() == [0] * 4
    monkeypatch.setattr(count_rows, "usable", lambda device: True)
    assert tk._check_counts(CPU)._base is not None


def test_the_docstring_example_runs():
    result = doctest.testmod(count_rows, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


def test_a_cuda_device_without_index_is_the_current_one(monkeypatch):
    """``torch.device("cuda")`` (what a user or a benchmark writes) takes rows from the block
    of ``cuda:N``, N the current device, and the stream query gets N, never None."""
    asked = []

    class Block:  # no CUDA memory here: a block that records where it was asked for
        def __init__(self, device):
            self.device = device

        def take(self):
            return self

    monkeypatch.setattr(count_rows, "_Block", Block)
    monkeypatch.setattr(count_rows, "_blocks", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(count_rows, "stream_of", lambda device: asked.append(device) or 5)
    plain = zeroed_counts(torch.device("cuda"))
    assert zeroed_counts(torch.device("cuda:1")) is plain
    assert plain.device == torch.device("cuda", 1)
    assert [d.index for d in asked] == [1, 1]


def test_the_gpu_checks_that_name_problems_keep_inputs_where_trees_are_loaded(monkeypatch):
    """In a whole GPU test run, an earlier torch.compile test loads Inductor's CUDA graph
    trees, after which the ops keep no input of a deferred check on CUDA (its pool may
    claim it): the checks that assert a problem's name lift that for their eager calls, and
    put it back after."""
    from robe_torchrec.ops import deferred_checks
    from robe_torchrec.testing import gpu_checks

    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", types.ModuleType("t"))
    cuda = torch.device("cuda", 0)
    assert deferred_checks.pools_may_claim(cuda) and not deferred_checks.pools_may_claim(CPU)
    with gpu_checks._eager_calls_as_without_graph_trees():
        assert not deferred_checks.pools_may_claim(cuda)
    assert deferred_checks.pools_may_claim(cuda)
