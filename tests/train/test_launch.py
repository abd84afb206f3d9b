"""The app as users launch it: the plain command (with a -m sweep), torchrun with 2 ranks
(one run directory; a killed rank, a restart that resumes from the last checkpoint and ends
bitwise where an uninterrupted run ends: the kill comes from the test-only wrapper
``tests.train.faulty_app``), torchx's local_cwd scheduler without the venv on PATH, bad
configs."""

from __future__ import annotations

import csv
import re
import sys

import pytest

from tests.train.helpers import (
    REPO,
    TINY,
    VENV_BIN,
    assert_same_tensors,
    read_checkpoint,
    run,
    run_dirs,
    torchrun,
)


def _csv(run_dir):
    return list(csv.DictReader(open(run_dir / "metrics.csv")))


@pytest.mark.slow
def test_plain_command_sweep_prints_metrics_and_writes_one_dir_per_job(tmp_path):
    out = run([sys.executable, "-m", "robe_torchrec.train", "-m", "run.steps=4",
               "embedding.compression=100,1000", *TINY], tmp_path, timeout=150)
    assert out.returncode == 0, out.stdout[-3000:]
    dirs = run_dirs(tmp_path / "multirun")
    assert [d.name for d in dirs] == ["0", "1"] and dirs[0].parent == dirs[1].parent
    for d, ratio in zip(dirs, (100, 1000)):
        log = (d / "train.log").read_text()
        shown = float(re.search(r"compression ([\d,.]+)x", log).group(1).replace(",", ""))
        assert abs(shown / ratio - 1) < 0.01 and "MiB" in log
        assert "samples/s" in log and "test log loss" in log and "AUC" in log
        phases = [r["phase"] for r in _csv(d)]
        assert phases == ["train", "train", "val", "test"], phases
        assert 0.0 < float(_csv(d)[-1]["auc"]) < 1.0


@pytest.mark.slow
def test_bad_config_on_the_command_line_fails_clearly(tmp_path):
    out = run([sys.executable, "-m", "robe_torchrec.train", "embedding.compression=0.5", *TINY],
              tmp_path, timeout=120)
    assert out.returncode != 0
    assert "embedding.compression must be >= 1" in out.stdout


@pytest.mark.slow
def test_two_ranks_killed_rank_restarts_resumes_and_matches_uninterrupted_run(tmp_path):
    common = ["run.steps=12", "run.checkpoint_every=4", *TINY]
    straight, faulty = tmp_path / "straight", tmp_path / "faulty"
    straight.mkdir(), faulty.mkdir()
    out = run(torchrun(2, *common), straight, timeout=200)
    assert out.returncode == 0, out.stdout[-3000:]
    # rank 1 dies after step 10; the last checkpoint is step 8
    out = run(torchrun(2, "--kill-rank", "1", "--kill-at-step", "10", *common,
                       max_restarts=1, module="tests.train.faulty_app"), faulty, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "fault injection: rank 1 exits at step 10" in out.stdout

    # one run directory per launch (not one per rank, nor per restart)
    (a,), (b,) = run_dirs(straight / "outputs"), run_dirs(faulty / "outputs")
    assert len(list((straight / "outputs").iterdir())) == 1
    assert len(list((faulty / "outputs").iterdir())) == 1
    log = (b / "train.log").read_text()
    assert "resumed from checkpoint" in log and "step_8 at step 8" in log
    assert "resumed" not in (a / "train.log").read_text()
    # rank 0 could not log step 10 before the crash (the metrics sync needs rank 1); the
    # restart logs steps 10 and 12 once each
    steps = [int(r["step"]) for r in _csv(b) if r["phase"] == "train"]
    assert steps == [2, 4, 6, 8, 10, 12], steps

    final_a = read_checkpoint(a / "checkpoints" / "step_12", tmp_path)
    final_b = read_checkpoint(b / "checkpoints" / "step_12", tmp_path)
    assert assert_same_tensors(final_a, final_b, "model.") >= 5
    assert assert_same_tensors(final_a, final_b, "optim.") >= 5
    assert {k for k in final_b if k.startswith("rng")} == {"rng_rank0.torch", "rng_rank1.torch"}


@pytest.mark.slow
def test_torchx_local_cwd_two_processes(tmp_path):
    # the venv is not activated: torchrun is not on PATH, the component finds it anyway
    out = run([str(VENV_BIN / "torchx"), "run", "-s", "local_cwd",
               str(REPO / "robe_torchrec" / "components.py") + ":train", "-j", "1x2", "--",
               "run.steps=4", *TINY], tmp_path, timeout=240, venv_on_path=False)
    assert out.returncode == 0 and "SUCCEEDED" in out.stdout, out.stdout[-3000:]
    (d,) = run_dirs(tmp_path / "outputs")
    assert d.name.startswith("robe-train-")  # outputs/<torchx app id>
    assert "2 rank(s)" in (d / "train.log").read_text()
    assert [r["phase"] for r in _csv(d)][-1] == "test"
