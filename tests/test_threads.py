"""The default thread count per rank: free cores (usable less busy) over the ranks of the
node, capped by torch's default, at least 1; a user's number wins."""

import os

import pytest
import torch

from robe_torchrec import threads as th


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ``set(usable, busy, local_world, torch_default)``."""
    def set_(usable, busy, local_world, torch_default):
        monkeypatch.setattr(th, "usable_cores", lambda: usable)
        monkeypatch.setattr(th, "busy_cores", lambda: busy)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        monkeypatch.setattr(torch, "get_num_threads", lambda: torch_default)
    return set_


@pytest.mark.parametrize("usable,busy,world,default,expected", [
    (2, 0.0, 1, 2, 2),     # a free 2-core machine: both cores
    (2, 1.0, 1, 2, 1),     # another process holds one core: not the torch default's 2
    (2, 0.4, 1, 2, 2),     # a core counts as taken once half of it is busy
    (2, 2.0, 1, 2, 1),     # everything busy: still 1
    (16, 0.0, 4, 16, 4),   # 4 ranks share the node
    (16, 3.0, 4, 16, 3),
    (64, 0.0, 1, 32, 32),  # hyperthreads: torch's default (physical cores) caps
    (8, 0.0, 2, 1, 1),     # OMP_NUM_THREADS=1 (torchrun's) caps too
])
def test_default(machine, usable, busy, world, default, expected):
    machine(usable, busy, world, default)
    choice = th.choose_threads(None)
    assert choice.threads == expected
    text = str(choice)
    assert f"{usable} usable" in text and f"{world} rank(s)" in text and "run.threads" in text


def test_requested_wins(machine):
    machine(2, 2.0, 1, 2)
    choice = th.choose_threads(3)
    assert choice.threads == 3 and "(run.threads)" in str(choice)
    with pytest.raises(ValueError, match="threads must be a positive number"):
        th.choose_threads(-1)


def test_busy_cores_reads_this_machine():
    busy = th.busy_cores(interval=0.05)
    assert 0.0 <= busy <= len(os.sched_getaffinity(0)) + 1e-6
    assert th.busy_cores(cpus=set()) == 0.0
