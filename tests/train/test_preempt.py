"""Preemption (docs/reliability.md): SIGTERM / SIGUSR1 on one rank or two stop the run after
the step in progress with a checkpoint of it; ``step_N.tmp`` leftovers go at the next start;
a stopped peer ends the run after ``run.collective_timeout``, naming the rank."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import List

import pytest

from robe_torchrec.train.preempt import StopSignals, Stopped
from robe_torchrec.train.trainer import Trainer, train
from tests.train import helpers
from tests.train.helpers import TINY, compose, one_rank_group

# long enough that a signal always lands mid-run; the run stops long before the end
LONG = [*TINY, "run.steps=100000", "run.log_every=1", "run.eval_batches=0",
        "run.test_batches=0"]


def test_sigterm_in_process_saves_the_step_reached(tmp_path, monkeypatch, caplog):
    """The signal arrives during step 3 (as the pipeline hands it over): the run trains
    the steps in flight, saves exactly there and raises Stopped (exit code 143)."""
    on_step = Trainer.on_step

    def signal_at_3(self, output):
        on_step(self, output)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "on_step", signal_at_3)
    with one_rank_group(), caplog.at_level(logging.INFO), pytest.raises(Stopped) as stop:
        train(compose("run.steps=50", "run.checkpoint_every=40"), tmp_path)
    step = stop.value.step
    assert stop.value.code == 128 + signal.SIGTERM and 3 <= step < 40
    assert f"stopped by SIGTERM at step {step}, checkpoint step_{step}" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step_{step}"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    monkeypatch.undo()
    (tmp_path / "checkpoints" / "step_1.tmp").mkdir()  # as a SIGKILL during a save leaves
    with one_rank_group(), caplog.at_level(logging.INFO):
        out = train(compose("run.steps=50", "run.checkpoint_every=40"), tmp_path)
    assert out["step"] == 50 and f"at step {step}" in caplog.text
    assert "removed step_1.tmp" in caplog.text
    assert not (tmp_path / "checkpoints" / "step_1.tmp").exists()


def test_stop_signals_agree_once_per_batch_without_a_group():
    signals = StopSignals(1, timeout=None)
    signals.install()
    try:
        batches = signals.until_stopped(iter(range(10)))
        assert next(batches) == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert list(batches) == []
        assert signals.settle() == signal.SIGUSR1
    finally:
        signals.uninstall()


def _wait_for(log: Path, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        m = re.search(pattern, text)
        if m:
            return m
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {log} after {timeout}s:\n{text[-3000:]}")


def _workers(marker: str) -> List[int]:
    """Pids of the app's processes started with ``ROBE_TEST_LAUNCH=marker``, by rank."""
    found = {}
    needle = f"ROBE_TEST_LAUNCH={marker}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if needle in env and b"robe_torchrec.train" in cmd and b"torchrun" not in cmd:
            rank = next((e.split(b"=")[1] for e in env if e.startswith(b"RANK=")), b"0")
            found[int(rank)] = int(pid)
    return [found[r] for r in sorted(found)]


def _launch(cmd: List[str], cwd: Path):
    marker = uuid.uuid4().hex
    log = cwd / f"launch-{marker[:8]}.log"
    out = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=helpers.env(marker), stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, marker, log, out


def _finish(proc, marker: str, out, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        helpers._kill_marked(marker)
        proc.wait()
        out.close()


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint(tmp_path, ranks):
    """A real SIGTERM to rank 0 alone (the other rank hears of it through the flag
    all-reduce): every rank stops at the same step, step_N is written, the log says so,
    the process exits 143; a second launch resumes there."""
    run_dir = tmp_path / "run"
    args = [*LONG, f"hydra.run.dir={run_dir}"]
    cmd = ([str(helpers.VENV_BIN / "python"), "-m", "robe_torchrec.train", *args] if ranks == 1
           else helpers.torchrun(2, *args))
    proc, marker, log, out = _launch(cmd, tmp_path)
    _wait_for(log, r"step 3 ", 300)
    pids = _workers(marker)
    assert len(pids) == ranks, pids
    os.kill(pids[0], signal.SIGTERM)
    code = _finish(proc, marker, out, 120)
    text = log.read_text()
    m = re.search(r"stopped by SIGTERM at step (\d+), checkpoint step_(\d+)", text)
    assert m and m.group(1) == m.group(2), text[-4000:]
    step = int(m.group(1))
    assert (run_dir / "checkpoints" / f"step_{step}").is_dir()
    assert code == (143 if ranks == 1 else 1), (code, text[-3000:])  # torchrun: 1 on failure
    assert "Traceback" not in text.split("stopped by SIGTERM")[0]
    # the next launch goes on from there
    args = [*TINY, f"run.steps={step + 2}", "run.log_every=1", f"hydra.run.dir={run_dir}"]
    again = helpers.run([str(helpers.VENV_BIN / "python"), "-m", "robe_torchrec.train", *args]
                        if ranks == 1 else helpers.torchrun(2, *args), tmp_path, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"at step {step}" in again.stdout


@pytest.mark.slow
def test_a_stopped_peer_ends_the_run_naming_its_rank(tmp_path):
    """SIGSTOP on rank 1: rank 0 waits run.collective_timeout seconds, not forever, and
    says which rank did not answer."""
    run_dir = tmp_path / "run"
    proc, marker, log, out = _launch(helpers.torchrun(2, *LONG, "run.collective_timeout=5",
                                                      f"hydra.run.dir={run_dir}"), tmp_path)
    try:
        _wait_for(log, r"step 3 ", 300)
        pids = _workers(marker)
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        _wait_for(log, r"CollectiveTimeout", 120)
        waited = time.monotonic() - start
    finally:
        _finish(proc, marker, out, 5)
    text = log.read_text()
    assert re.search(r"rank 0: a collective waited more than run.collective_timeout=5s at "
                     r"step \d+; rank\(s\) 1 did not answer", text), text[-4000:]
    assert waited < 90
