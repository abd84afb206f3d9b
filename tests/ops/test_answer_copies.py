"""Answers of several forwards in one copy (``robe_torchrec/ops/answer_copies.py``), on
CPU tensors, where a copy is a plain copy and has no event: which rows a copy carries, when
it goes out, and that every answer read is its own row's, whatever the rows around it."""

import doctest
import threading

import pytest
import torch

from robe_torchrec.ops import answer_copies, count_rows
from robe_torchrec.ops.answer_copies import join
from robe_torchrec.ops.count_rows import ROWS_PER_BLOCK, zeroed_counts

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_blocks(monkeypatch):
    """Every test starts from a new block of rows on a stream of its own."""
    monkeypatch.setattr(count_rows, "_blocks", {})
    monkeypatch.setattr(answer_copies, "_blocks", {})


def counted(value: int) -> torch.Tensor:
    """A row as a kernel leaves it: its counts written before the answer joins a copy."""
    row = zeroed_counts(CPU)
    row.copy_(torch.tensor([value, 0, value, 1]))
    return row


def test_a_copy_goes_out_when_full_and_carries_each_row_answer():
    joined = [join(counted(v), answers_per_copy=3) for v in (5, 6, 7, 8)]
    first, second = joined[0][0], joined[3][0]
    assert joined[1][0] is first and joined[2][0] is first and second is not first
    assert first.sent and first.ready() and not second.sent and not second.ready()
    assert [copy.read(row) for copy, row in joined] == [[v, 0, v, 1] for v in (5, 6, 7, 8)]
    assert second.sent  # reading an answer sends its copy


def test_a_row_written_after_the_copy_went_out_is_not_read():
    """What a read returns is what the copy took when it went out (the host's mirror), not
    the row as it is now."""
    row = counted(3)
    copy, index = join(row, answers_per_copy=1)
    row.fill_(9)
    assert copy.read(index) == [3, 0, 3, 1]


def test_rows_joining_out_of_order_are_all_carried():
    """Two threads take rows one after the other and join in the other order."""
    taken = [counted(41), counted(42), counted(43)]
    joined = [join(taken[i], answers_per_copy=3) for i in (1, 0, 2)]
    assert [copy.read(row)[0] for copy, row in joined] == [42, 41, 43]


def test_a_block_that_handed_out_its_last_row_sends_its_copy():
    for _ in range(ROWS_PER_BLOCK - 2):
        zeroed_counts(CPU)  # rows whose answers were read at their call: in no copy
    copy, _ = join(counted(1), answers_per_copy=8)
    last, _ = join(counted(2), answers_per_copy=8)
    assert last is copy and copy.sent and copy.size == 2
    assert not answer_copies._blocks, "the used-up block is still followed"


def test_rows_of_two_streams_join_copies_of_their_own(monkeypatch):
    stream = [1]
    monkeypatch.setattr(count_rows, "stream_of", lambda device: stream[0])
    joined = []
    for i in range(6):  # forwards alternating between two streams
        stream[0] = 1 + i % 2
        joined.append(join(counted(i), answers_per_copy=3))
    copies = {id(copy) for copy, _ in joined}
    assert len(copies) == 2 and all(copy.sent for copy, _ in joined)
    assert [copy.read(row)[0] for copy, row in joined] == list(range(6))


def test_counts_of_their_own_join_no_copy():
    assert join(torch.zeros(4, dtype=torch.int64), answers_per_copy=8) is None


def test_blocks_followed_are_bounded_and_their_copies_go_out(monkeypatch):
    stream = [0]
    monkeypatch.setattr(count_rows, "stream_of", lambda device: stream[0])
    joined = []
    for stream[0] in range(3 * answer_copies._MAX_BLOCKS):
        joined.append(join(counted(stream[0]), answers_per_copy=8))
    assert len(answer_copies._blocks) <= answer_copies._MAX_BLOCKS
    assert all(copy.sent for copy, _ in joined[:answer_copies._MAX_BLOCKS])
    assert [copy.read(row)[0] for copy, row in joined] == list(range(len(joined)))


def test_threads_joining_at_once_lose_no_answer():
    joined, start = [[], []], threading.Barrier(2)

    def forwards(me: int) -> None:
        start.wait()
        for i in range(300):
            joined[me].append((me * 1000 + i, join(counted(me * 1000 + i), 5)))

    threads = [threading.Thread(target=forwards, args=(me,)) for me in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for value, (copy, row) in joined[0] + joined[1]:
        assert copy.read(row)[0] == value


def test_module_example():
    namespace = {"torch": torch, "zeroed_counts": zeroed_counts, "join": join}
    failed, attempted = doctest.testmod(answer_copies, extraglobs=namespace)[:2]
    assert attempted and not failed


@pytest.mark.parametrize("made_under_inference", ["block", "answers"])
def test_state_first_made_in_an_evaluation_serves_training_calls(made_under_inference):
    """A block of rows, or its host mirror, made by a call under ``torch.inference_mode()``
    (an evaluation) lives on for the training calls after it, which write rows and copy
    answers into the mirror: both must be normal tensors."""
    with torch.inference_mode(made_under_inference == "block"):
        first = zeroed_counts(CPU)
    with torch.inference_mode(made_under_inference == "answers"):
        join(first, answers_per_copy=8)
    assert not first.is_inference()
    copy, row = join(counted(7), answers_per_copy=8)
    assert copy.read(row) == [7, 0, 7, 1]
