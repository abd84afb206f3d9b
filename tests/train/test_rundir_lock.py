"""One owner per run directory, always (docs/reliability.md): the lock is an ``fcntl.flock``
the kernel releases when its process ends, so whatever a dead owner left in the lock file
(its pid, nothing, garbage) is taken over, and processes racing for it never both win."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys

import pytest

from robe_torchrec.train.rundir import LOCK_NAME, RunDirLocked, RunLock

RACERS, TRIALS = 6, 40


def _race(run_dir: str, start, done, wins) -> None:
    lock = RunLock(run_dir)
    start.wait()
    try:
        lock.acquire()
        won = True
    except RunDirLocked:
        won = False
    with wins.get_lock():
        wins.value += won
    done.wait()  # every racer has tried before any owner lets go
    if won:
        lock.release()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


@pytest.mark.slow
@pytest.mark.parametrize("left", ["dead_owner", "empty", "garbage"])
def test_racing_processes_never_both_own_the_directory(tmp_path, left):
    """Before each trial the lock file holds what a dead owner leaves; 6 processes race
    for it: exactly one wins, 40 times out of 40 (the takeover by unlink and re-create
    let 2 or more win in most trials)."""
    ctx = multiprocessing.get_context("fork")
    contents = {"dead_owner": json.dumps({"host": os.uname().nodename, "pid": _dead_pid()}),
                "empty": "", "garbage": "\x00\x17{not json"}
    owners = []
    for trial in range(TRIALS):
        run_dir = tmp_path / str(trial)
        run_dir.mkdir()
        (run_dir / LOCK_NAME).write_text(contents[left])
        start, done = ctx.Barrier(RACERS), ctx.Barrier(RACERS)
        wins = ctx.Value("i", 0)
        procs = [ctx.Process(target=_race, args=(str(run_dir), start, done, wins))
                 for _ in range(RACERS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        owners.append(wins.value)
    assert owners == [1] * TRIALS


@pytest.mark.parametrize("content", ["", "garbage \x00", '{"pid": 1'])
def test_an_empty_or_garbage_lock_file_is_taken_over(tmp_path, content, caplog):
    """What a crash between creating the lock file and writing it leaves."""
    (tmp_path / LOCK_NAME).write_text(content)
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    if content:
        assert "taking over the lock" in caplog.text
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_live_owner_keeps_the_directory_until_it_ends(tmp_path):
    """A live process holding the lock refuses everyone, naming it; once it is killed
    (SIGKILL: no clean-up of its own) the kernel has released the lock."""
    code = ("import sys, time; from robe_torchrec.train.rundir import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert owner.stdout.readline().strip() == "held"
        with pytest.raises(RunDirLocked, match=f"in use by pid {owner.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        owner.kill()
        owner.wait()
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
