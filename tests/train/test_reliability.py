"""Fault injection for the training app, in-process on a 1-rank group (docs/reliability.md):
non-finite training and rollbacks, damaged and unusable checkpoints, a full disk, a second run
in the same directory, bad paths, and resumes with changed configs. One short run (``base``) is trained once and copied for
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


def test_a_deferred_input_problem_stops_the_run_before_its_checkpoint(tmp_path, monkeypatch):
    """On a GPU the ops read their input checks after returning: a problem still unread at
    a segment's end raises there, before the checkpoint of that segment is written (and the
    earlier checkpoint stays)."""
    from robe_torchrec.ops.deferred_checks import DeferredCheckError
    from robe_torchrec.train import trainer as trainer_module

    reads = []

    def pending_problem_at_step_4():
        reads.append(None)
        if len(reads) == 2:  # the second segment's end (step 4)
            raise DeferredCheckError("robe: id 7 at position 3 of feature 0 is out of range")

    monkeypatch.setattr(trainer_module, "raise_pending_checks", pending_problem_at_step_4)
    with one_rank_group(), pytest.raises(DeferredCheckError, match="id 7 at position 3"):
        train(compose("run.steps=6", "run.checkpoint_every=2", "run.keep_checkpoints=0",
                      "run.eval_every=0"), tmp_path)
    assert _steps(tmp_path) == ["step_2"]


def test_a_deferred_input_problem_of_an_evaluation_pass_writes_no_metric(tmp_path,
                                                                         monkeypatch):
    """A problem unread when an evaluation pass ends raises before its metrics are
    computed: no validation or test row comes from a batch whose input failed its checks."""
    from robe_torchrec.ops.deferred_checks import DeferredCheckError
    from robe_torchrec.train import trainer as trainer_module

    evaluating, metrics = [], trainer_module.Trainer.metrics

    def metrics_noted(self, *args, **kwargs):
        evaluating.append(True)
        return metrics(self, *args, **kwargs)

    def problem_in_evaluation():
        if evaluating:
            raise DeferredCheckError("robe: id 7 at position 3 of feature 0 is out of range")

    monkeypatch.setattr(trainer_module.Trainer, "metrics", metrics_noted)
    monkeypatch.setattr(trainer_module, "raise_pending_checks", problem_in_evaluation)
    with one_rank_group(), pytest.raises(DeferredCheckError, match="id 7 at position 3"):
        train(compose("run.steps=2", "run.checkpoint_every=0"), tmp_path)
    assert not any(phase in ("val", "test") for phase, _ in _metric_keys(tmp_path))


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


def _poison_every_time_at(monkeypatch, step: int, lrs: list) -> None:
    """Fill a dense weight with NaN each time ``step`` trains; record the learning rates
    it trained at."""
    on_step = Trainer.on_step

    def poisoned(self, output):
        on_step(self, output)
        if self.step == step:
            lrs.append(sorted({g["lr"] for g in self.optimizer.param_groups}))
            with torch.no_grad():
                next(self.dmp.module.model.dense_arch.parameters()).fill_(float("nan"))

    monkeypatch.setattr(Trainer, "on_step", poisoned)


def test_rollbacks_compound_the_learning_rate_scale(copy, monkeypatch, caplog):
    """The k-th rollback trains at lr x 0.5^k: 0.05, then 0.025, 0.0125, 0.00625 (not
    0.025 three times, repeating the first rollback's run into the same NaN)."""
    lrs: list = []
    _poison_every_time_at(monkeypatch, 5, lrs)
    every = ["run.checkpoint_every=2", "run.on_nonfinite=rollback", "run.check_every=1"]
    with one_rank_group(), caplog.at_level(logging.WARNING), \
            pytest.raises(NonFiniteError, match="3 rollback.*max_rollbacks=3"):
        train(compose("run.steps=8", *every), copy)
    assert lrs == [[0.05], [0.025], [0.0125], [0.00625]]
    assert "x 0.125 (now 0.00625, 0.00625; rollback 3 of at most 3)" in caplog.text


def test_a_rollback_that_would_repeat_another_stops_saying_so(copy, monkeypatch):
    """At learning rate 0 scaling changes nothing: the second rollback would train the
    same batches at the same rates as the first and meet the same NaN."""
    _poison_every_time_at(monkeypatch, 5, [])
    with one_rank_group(), pytest.raises(NonFiniteError, match=r"rollback 2 would repeat "
                                         r"rollback 1 exactly \(checkpoint step_4, the same "
                                         r"batches, learning rates 0, 0\)"):
        train(compose("run.steps=8", "run.checkpoint_every=2", "run.on_nonfinite=rollback",
                      "run.check_every=1", "optimizer.dense_lr=0", "optimizer.embedding_lr=0"),
              copy)


# ---------------------------------------------------------------- damaged checkpoints

@pytest.mark.parametrize("damage", ["bit_flip", "truncate_unverified"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(copy, caplog, damage):
    newest = copy / "checkpoints" / "step_4"
    data = _distcp(newest)
    if damage == "bit_flip":  # caught by the checksum
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    else:  # no manifest (an older version's, or planted): refused unless allowed
        (newest / MANIFEST).unlink()
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    with one_rank_group(), caplog.at_level(logging.WARNING):
        trainer = _resumed(compose("run.steps=4", *BASE), copy)
    assert trainer.step == 2
    assert f"checkpoint {newest} is unusable" in caplog.text
    why = "checksum mismatch" if damage == "bit_flip" else \
        f"it has no {MANIFEST} (written by an older version, or not by this app)"
    assert why in caplog.text
    assert _steps(copy) == ["step_2", "step_4.bad"]
    # no metrics row is dropped without a copy: those past step 2 are kept aside
    assert ("train", "4") not in _metric_keys(copy)
    with open(copy / "metrics.dropped.csv") as f:
        assert ("train", "4") in [(r["phase"], r["step"]) for r in csv.DictReader(f)]


def test_a_checkpoint_without_manifest_loads_only_when_allowed(copy, caplog):
    """A flipped bit in a manifest-less checkpoint cannot be found, so such a checkpoint
    is refused unless run.allow_unverified=true says to trust it."""
    (copy / "checkpoints" / "step_4" / MANIFEST).unlink()
    with one_rank_group(), caplog.at_level(logging.WARNING):
        trainer = _resumed(compose("run.steps=4", *BASE, "run.allow_unverified=true"), copy)
    assert trainer.step == 4 and "its files are not verified" in caplog.text


def test_eval_of_a_damaged_checkpoint_is_refused(copy, tmp_path):
    ckpt = copy / "checkpoints" / "step_4"
    data = _distcp(ckpt)
    data.write_bytes(data.read_bytes()[:-8] + bytes(8))
    with one_rank_group(), pytest.raises(CheckpointError, match=f"run.checkpoint={ckpt} is "
                                                                f"unusable: .*checksum"):
        evaluate(compose("run.mode=eval", f"run.checkpoint={ckpt}"), tmp_path / "eval")


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(copy):
    """The first launch sets them aside as step_N.bad and stops; the same command again
    (what torchrun --max-restarts does by itself) must not start over from step 0 and drop
    the earlier rows of metrics.csv: only run.resume=false run.existing_checkpoints=move
    starts over, with the old checkpoints and metrics renamed aside."""
    for step in ("step_2", "step_4"):
        (copy / "checkpoints" / step / ".metadata").write_bytes(b"garbage")
    rows = _metric_keys(copy)
    with one_rank_group(), pytest.raises(CheckpointError, match="no usable checkpoint in .*"
                                                                "step_4: .*step_2: "):
        train(compose("run.steps=6", *BASE), copy)
    assert _steps(copy) == ["step_2.bad", "step_4.bad"]
    with one_rank_group(), pytest.raises(CheckpointError, match=(
            r"holds only unusable checkpoints of an earlier run \(step_4.bad: .*\.metadata"
            r".*step_2.bad: .*\): this run would start over from step 0. To start over on "
            r"purpose, set run.resume=false run.existing_checkpoints=move")):
        train(compose("run.steps=6", *BASE), copy)
    assert _metric_keys(copy) == rows and _steps(copy) == ["step_2.bad", "step_4.bad"]
    with one_rank_group(), pytest.raises(ConfigError, match="run.resume=false but"):
        train(compose("run.steps=2", "run.resume=false", *BASE), copy)
    with one_rank_group():
        out = train(compose("run.steps=2", "run.resume=false", "run.existing_checkpoints=move",
                            *BASE), copy)
    assert out["step"] == 2 and _steps(copy) == ["step_2"]
    (old,) = copy.glob("checkpoints.old-*")
    assert sorted(p.name for p in old.iterdir()) == ["step_2.bad", "step_4.bad"]
    (old_metrics,) = copy.glob("metrics.old-*.csv")
    with open(old_metrics) as f:
        assert [(r["phase"], r["step"]) for r in csv.DictReader(f)] == rows


def test_a_file_where_a_checkpoint_goes_is_named_before_step_one(copy, monkeypatch):
    """A regular file at checkpoints/step_6 would make every save of step 6 fail (ENOTDIR)."""
    (copy / "checkpoints" / "step_6").write_text("not a checkpoint")
    def no_training(self):
        raise AssertionError("training started")

    monkeypatch.setattr(Trainer, "run_segment", no_training)
    with one_rank_group(), pytest.raises(CheckpointError, match=(
            f"{copy / 'checkpoints' / 'step_6'} is not a checkpoint directory \\(a regular "
            f"file\\): every save of step 6 would fail on it")):
        train(compose("run.steps=6", *BASE), copy)


def test_bad_paths_are_named_before_step_one(tmp_path):
    """A directory given as a data file, run.export naming a directory."""
    from robe_torchrec.train.config import validate
    from robe_torchrec.train.data import build_data

    (tmp_path / "day_0").mkdir()
    cfg = compose("data=criteo_tsv", f"data.train={tmp_path / 'day_0'}")
    with pytest.raises(ConfigError, match=f"data.train: {tmp_path / 'day_0'} is a directory, "
                                          f"not a data file"):
        build_data(cfg, 0, 1)
    (tmp_path / "p_dense.npy").mkdir()
    with pytest.raises(ConfigError, match="data.train: .*p_dense.npy is a directory"):
        build_data(compose("data=criteo_npy", f"data.train={tmp_path / 'p'}"), 0, 1)
    with pytest.raises(ConfigError, match=f"run.export={tmp_path} is a directory; give the "
                                          f"file to write"):
        validate(compose(f"run.export={tmp_path}"))
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file, so the program cannot be written"):
        validate(compose(f"run.export={tmp_path / 'f' / 'x.pt2'}"))


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
    assert "taking over the lock" in caplog.text and "at step 2" in caplog.text
    assert "removed step_4.tmp" in caplog.text
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
    ("embedding.compression=50", "embedding.compression: 1000.0 -> 50.0"),  # typed: a float
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
    code = ("import sys, time; from robe_torchrec.train.rundir import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=helpers.env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        lock = json.loads((tmp_path / LOCK_NAME).read_text())
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
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "h", "pid": int(dead),
                                                  "since": "then"}))
    with caplog.at_level(logging.WARNING):
        second = RunLock(tmp_path)
        second.acquire()
    assert f"taking over the lock {tmp_path / LOCK_NAME} left by pid {dead} on host h " \
           f"(since then), which has ended" in caplog.text
    second.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_run_stamps_differ_within_one_second():
    from robe_torchrec.train.app import agree_on_run_stamp

    with one_rank_group():
        stamps = {agree_on_run_stamp() for _ in range(5)}
    assert len(stamps) == 5
