"""Fault injection for the training app, in-process on a 1-rank group (docs/reliability.md):
non-finite training, damaged checkpoints, a full disk, a second run in the same directory,
and resumes with changed configs. One short run (``base``) is trained once and copied for
the tests that damage or continue it."""

from __future__ import annotations

import csv
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from robe_torchrec.train import checkpoint as checkpoint_module
from robe_torchrec.train.checkpoint import CheckpointError, CheckpointSaveError, MANIFEST
from robe_torchrec.train.config import ConfigError
from robe_torchrec.train.resume import ResumeMismatch, compare, fingerprint
from robe_torchrec.train.rundir import LOCK_NAME, RunDirLocked, RunLock
from robe_torchrec.train.trainer import NonFiniteError, Trainer, evaluate, train
from tests.train import helpers
from tests.train.helpers import TINY, assert_same_tensors, compose, one_rank_group, read_checkpoint

# the base run: 4 steps, a checkpoint every 2, all kept
BASE = ("run.checkpoint_every=2", "run.keep_checkpoints=0")


@pytest.fixture(scope="session")  # see tests/conftest.py: built once per worker
def base(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("base") / "run"
    with one_rank_group():
        train(compose("run.steps=4", *BASE), run_dir)
    return run_dir


@pytest.fixture
def copy(base, tmp_path) -> Path:
    """A copy of the base run to damage or continue."""
    return Path(shutil.copytree(base, tmp_path / "run"))


def _steps(run_dir: Path):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _metric_keys(run_dir: Path):
    with open(run_dir / "metrics.csv") as f:
        return [(r["phase"], r["step"]) for r in csv.DictReader(f)]


def _resumed(cfg, run_dir: Path) -> Trainer:
    """A trainer built and resumed in ``run_dir`` (its lock released again)."""
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.build()
        trainer.resume()
    finally:
        trainer.close()
    return trainer


def _distcp(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


# ---------------------------------------------------------------- non-finite guard

def test_nonfinite_loss_stops_and_keeps_the_good_checkpoint(tmp_path, caplog):
    """The issue's run: SGD at lr 1e4 goes inf/NaN within a few steps. Resumed from a good
    step 4 with that learning rate (an allowed change), it stops naming the step; no
    checkpoint is written from the bad state, and rotation (keep 1) keeps step_4."""
    sgd = ["optimizer=sgd", "run.checkpoint_every=4", "run.keep_checkpoints=1"]
    with one_rank_group(), caplog.at_level(logging.WARNING):
        train(compose("run.steps=4", *sgd), tmp_path)
        with pytest.raises(NonFiniteError, match=r"non-finite values at step 8: the loss is "
                                                 r"not finite since step \d.*no checkpoint"):
            train(compose("run.steps=40", *sgd, "optimizer.dense_lr=1e4",
                          "optimizer.embedding_lr=1e4"), tmp_path)
    assert "optimizer.dense_lr changed from 0.1 (checkpoint) to 10000.0" in caplog.text
    assert _steps(tmp_path) == ["step_4"]


def _poison_once_at(monkeypatch, step: int) -> None:
    """Fill a dense weight with NaN after ``step`` trains (once per test)."""
    on_step, done = Trainer.on_step, []

    def poisoned(self, output):
        on_step(self, output)
        if self.step == step and not done:
            done.append(step)
            with torch.no_grad():
                next(self.dmp.module.model.dense_arch.parameters()).fill_(float("nan"))

    monkeypatch.setattr(Trainer, "on_step", poisoned)


def test_nonfinite_weights_roll_back_with_a_lower_learning_rate(copy, monkeypatch, caplog):
    _poison_once_at(monkeypatch, 5)
    every = ["run.checkpoint_every=2", "run.on_nonfinite=rollback", "run.check_every=1"]
    with one_rank_group(), caplog.at_level(logging.WARNING):
        out = train(compose("run.steps=8", *every), copy)
    assert out["step"] == 8
    assert "non-finite values at step 5: inf/NaN values in model." in caplog.text
    assert "dense_arch" in caplog.text
    assert "rolled back to checkpoint" in caplog.text and "(step 4)" in caplog.text
    final = read_checkpoint(copy / "checkpoints" / "step_8", copy)
    assert all(torch.isfinite(t).all() for t in final.values() if t.is_floating_point())
    keys = _metric_keys(copy)
    assert len(keys) == len(set(keys)), keys  # step 5 was logged twice, kept once
    with one_rank_group():  # the lowered learning rates are in the checkpoint
        trainer = _resumed(compose("run.steps=8", *every), copy)
    assert {g["lr"] for g in trainer.optimizer.param_groups} == {0.025}  # 0.05 x 0.5

    # no rollbacks left: stop
    monkeypatch.undo()
    _poison_once_at(monkeypatch, 10)
    with one_rank_group(), pytest.raises(NonFiniteError, match="max_rollbacks=0"):
        train(compose("run.steps=12", *every, "run.max_rollbacks=0"), copy)


# ---------------------------------------------------------------- damaged checkpoints

@pytest.mark.parametrize("damage", ["bit_flip", "truncate_unverified"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(copy, caplog, damage):
    newest = copy / "checkpoints" / "step_4"
    data = _distcp(newest)
    if damage == "bit_flip":  # caught by the checksum
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    else:  # no manifest (an older version's checkpoint): DCP's read error is caught
        (newest / MANIFEST).unlink()
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    with one_rank_group(), caplog.at_level(logging.WARNING):
        trainer = _resumed(compose("run.steps=4", *BASE), copy)
    assert trainer.step == 2
    assert f"checkpoint {newest} is unusable" in caplog.text
    why = "checksum mismatch" if damage == "bit_flip" else "cannot be read"
    assert why in caplog.text
    assert _steps(copy) == ["step_2", "step_4.bad"]


def test_eval_of_a_damaged_checkpoint_is_refused(copy, tmp_path):
    ckpt = copy / "checkpoints" / "step_4"
    data = _distcp(ckpt)
    data.write_bytes(data.read_bytes()[:-8] + bytes(8))
    with one_rank_group(), pytest.raises(CheckpointError, match=f"run.checkpoint={ckpt} is "
                                                                f"unusable: .*checksum"):
        evaluate(compose("run.mode=eval", f"run.checkpoint={ckpt}"), tmp_path / "eval")


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(copy):
    for step in ("step_2", "step_4"):
        (copy / "checkpoints" / step / ".metadata").write_bytes(b"garbage")
    with one_rank_group(), pytest.raises(CheckpointError, match="no usable checkpoint in .*"
                                                                "step_4: .*step_2: "):
        train(compose("run.steps=6", *BASE), copy)


# ---------------------------------------------------------------- saving

@pytest.mark.slow
def test_sigkill_during_save_then_resume_equals_uninterrupted_run(tmp_path, caplog):
    """A real SIGKILL once DCP has written step_4.tmp (before its manifest and rename): the
    resume (in-process; it takes over the dead process's lock) starts from step_2 and ends
    bitwise equal to an uninterrupted run, with one metrics row per step."""
    every = ["run.checkpoint_every=2", "run.keep_checkpoints=0"]
    killed = subprocess.run([sys.executable, "-m", "tests.train.faulty_app", "--sigkill-in-save",
                             "4", *TINY, "run.steps=6", *every, f"hydra.run.dir={tmp_path / 'r'}"],
                            cwd=helpers.REPO, env=helpers.env(), timeout=300,
                            capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _steps(tmp_path / "r") == ["step_2", "step_4.tmp"]
    with one_rank_group(), caplog.at_level(logging.INFO):
        train(compose("run.steps=6", *every), tmp_path / "r")
        train(compose("run.steps=6", *every), tmp_path / "straight")
    assert "taking over the stale lock" in caplog.text and "at step 2" in caplog.text
    a = read_checkpoint(tmp_path / "r" / "checkpoints" / "step_6", tmp_path)
    b = read_checkpoint(tmp_path / "straight" / "checkpoints" / "step_6", tmp_path)
    assert assert_same_tensors(a, b, "model.") >= 5 and assert_same_tensors(a, b, "optim.") >= 5
    keys = _metric_keys(tmp_path / "r")
    assert len(keys) == len(set(keys)), keys


@pytest.mark.parametrize("code, says", [(errno.ENOSPC, "the disk is full"),
                                        (errno.EIO, "an I/O error")])
def test_failed_save_is_named_and_leaves_the_previous_checkpoint(copy, monkeypatch, code,
                                                                 says):
    def fails_midway(state, checkpoint_id):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"partial")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(checkpoint_module.dcp, "save", fails_midway)
    with one_rank_group(), pytest.raises(CheckpointSaveError) as err:
        train(compose("run.steps=6", *BASE), copy)
    assert says in str(err.value) and "step_6.tmp was removed" in str(err.value)
    assert f"newest checkpoint kept is {copy / 'checkpoints' / 'step_4'}" in str(err.value)
    assert _steps(copy) == ["step_2", "step_4"]
    assert not (copy / LOCK_NAME).exists()  # released on the way out


def test_manifest_records_run_config_and_checksums(base):
    manifest = json.loads((base / "checkpoints" / "step_4" / MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 1 and len(manifest["run_id"]) == 12
    assert manifest["config"]["run.batch_size"] == 32
    assert manifest["config"]["embedding.compression"] is not None
    assert {".metadata", "__0_0.distcp"} <= set(manifest["files"])


# ---------------------------------------------------------------- resume checks

@pytest.mark.parametrize("change, key", [
    ("embedding.compression=50", "embedding.compression: 1000 -> 50"),
    ("run.batch_size=16", "run.batch_size: 32 -> 16 (the data position"),
    ("data.seed=1", "data.seed: 0 -> 1"),
    ("run.seed=1", "run.seed: 0 -> 1"),
    ("optimizer=sgd", "optimizer.name: 'adagrad' -> 'sgd'"),
    ("model.over_arch_layer_sizes=[32,1]", "model.over_arch_layer_sizes: [64, 32, 1] -> [32, 1]"),
])
def test_resume_with_another_config_is_refused_with_the_differences(copy, change, key):
    with one_rank_group(), pytest.raises(ResumeMismatch) as err:
        train(compose("run.steps=6", *BASE, change), copy)
    assert key in str(err.value) and "checkpoint_4" not in str(err.value)
    assert _steps(copy) == ["step_2", "step_4"]


def test_world_size_change_is_refused_with_the_reason():
    one, two = fingerprint(compose(), 1), fingerprint(compose(), 2)
    changes = compare(one, two)
    assert changes.refused == {"world_size": (1, 2)} and not changes.allowed


def test_run_steps_before_the_checkpoint_is_refused(copy):
    with one_rank_group(), pytest.raises(ConfigError, match=r"at step 4, past run.steps=3.*"
                                                            r"run.mode=eval"):
        train(compose("run.steps=3", *BASE), copy)


def test_learning_rate_change_on_resume_is_applied_and_logged(copy, caplog):
    with one_rank_group(), caplog.at_level(logging.WARNING):
        trainer = _resumed(compose("run.steps=6", *BASE, "optimizer.embedding_lr=0.5"), copy)
    groups = dict(trainer.optimizer.optimizers)
    assert {g["lr"] for g in groups["embedding"].param_groups} == {0.5}
    assert {g["lr"] for g in groups["dense"].param_groups} == {0.05}
    assert "optimizer.embedding_lr changed from 0.05 (checkpoint) to 0.5: applied" in caplog.text


def test_resume_false_refuses_or_moves_another_runs_checkpoints(copy, caplog):
    with one_rank_group():
        with pytest.raises(ConfigError, match="run.resume=false but .* holds checkpoints"):
            train(compose("run.steps=2", "run.resume=false", *BASE), copy)
        with caplog.at_level(logging.WARNING):
            out = train(compose("run.steps=2", "run.resume=false", *BASE,
                                "run.existing_checkpoints=move"), copy)
    assert out["step"] == 2 and "moved the earlier run's checkpoints" in caplog.text
    assert _steps(copy) == ["step_2"]
    moved = [p.name for p in copy.iterdir() if p.name.startswith("checkpoints.old-")]
    assert len(moved) == 1 and (copy / moved[0] / "step_4").is_dir()


def test_rotation_keeps_only_this_runs_checkpoints(copy):
    """A copied-in checkpoint of another run id is never rotated away; this run's are."""
    other = copy / "checkpoints" / "step_2"
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["run_id"] = "someoneelse0"
    (other / MANIFEST).write_text(json.dumps(manifest))
    with one_rank_group():
        train(compose("run.steps=8", "run.checkpoint_every=2", "run.keep_checkpoints=1"), copy)
    assert _steps(copy) == ["step_2", "step_8"]
    keys = _metric_keys(copy)
    assert len(keys) == len(set(keys)), keys


# ---------------------------------------------------------------- one run per directory

def test_second_run_in_a_locked_directory_fails_at_once(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        RunLock(tmp_path).acquire()  # this process's lock ...
        lock = json.loads((tmp_path / LOCK_NAME).read_text())
        lock["pid"] = owner.pid  # ... held by a live process
        (tmp_path / LOCK_NAME).write_text(json.dumps(lock))
        with one_rank_group(), pytest.raises(RunDirLocked, match=f"in use by pid {owner.pid} "
                                                                 f"on host {lock['host']}"):
            train(compose("run.steps=2"), tmp_path)
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.csv").exists()
    finally:
        owner.kill()
        owner.wait()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    lock = RunLock(tmp_path)
    lock.acquire()
    owner = json.loads((tmp_path / LOCK_NAME).read_text())
    (tmp_path / LOCK_NAME).write_text(json.dumps({**owner, "pid": int(dead)}))
    lock.held = False
    with caplog.at_level(logging.WARNING):
        second = RunLock(tmp_path)
        second.acquire()
    assert f"taking over the stale lock {tmp_path / LOCK_NAME} (pid {dead} is not running)" \
        in caplog.text
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_run_stamps_differ_within_one_second():
    from robe_torchrec.train.app import agree_on_run_stamp

    with one_rank_group():
        stamps = {agree_on_run_stamp() for _ in range(5)}
    assert len(stamps) == 5
