"""Checkpoints and exact resume, in-process on a 1-rank group: a run of 2N steps ends with
the same weights and optimizer state, bit for bit, as a run of N steps resumed for N more."""

from __future__ import annotations

import logging

import pytest

from robe_torchrec.train.config import ConfigError
from robe_torchrec.train.trainer import train
from tests.train.helpers import (
    assert_same_tensors,
    compose,
    one_rank_group,
    read_checkpoint,
)

N = 4


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    [],                                                      # ROBE-Z, DLRM, fused Adagrad
    ["embedding=full"],                                      # FBGEMM TBE, fused Adagrad
    ["model=dcn", "optimizer=adam", "embedding.shared=false", "pipeline=plain"],
    ["pipeline=fused_sparse_dist", "embedding.hash=mix"],
    # semi-sync from batch 2: a resumed run must count its batches from the resume step
    ["pipeline=semi_sync", "pipeline.options.start_batch=2"],
], ids=["robe-adagrad", "full-adagrad", "robe-pertable-dcn-adam-plain", "robe-mix-fused-sparse-dist",
        "robe-semi-sync"])
def test_resumed_run_equals_uninterrupted_run_bitwise(tmp_path, caplog, overrides):
    every = [f"run.checkpoint_every={N}", *overrides]
    with one_rank_group():
        straight = train(compose(f"run.steps={2 * N}", *every), tmp_path / "straight")
        first = train(compose(f"run.steps={N}", *every), tmp_path / "resumed")
        with caplog.at_level(logging.INFO, logger="robe_torchrec.train"):
            resumed = train(compose(f"run.steps={2 * N}", *every), tmp_path / "resumed")
    assert f"at step {N}" in caplog.text and "resumed from checkpoint" in caplog.text
    assert first["step"] == N and straight["step"] == resumed["step"] == 2 * N

    a = read_checkpoint(tmp_path / "straight" / "checkpoints" / f"step_{2 * N}", tmp_path)
    b = read_checkpoint(tmp_path / "resumed" / "checkpoints" / f"step_{2 * N}", tmp_path)
    assert assert_same_tensors(a, b, "model.") >= 5
    assert assert_same_tensors(a, b, "optim.") >= 5
    assert int(a["trainer.step"]) == int(b["trainer.step"]) == 2 * N
    # the check can fail: N more steps did change the weights
    mid = read_checkpoint(tmp_path / "resumed" / "checkpoints" / f"step_{N}", tmp_path)
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_tensors(a, mid, "model.")
    assert straight["test_auc"] == resumed["test_auc"]


@pytest.mark.slow
def test_resume_true_without_checkpoint_is_an_error(tmp_path):
    with one_rank_group(), pytest.raises(ConfigError, match="no checkpoint in"):
        train(compose("run.steps=2", "run.resume=true"), tmp_path / "empty")


@pytest.mark.slow
def test_resume_false_moves_old_checkpoints_aside_and_rotation_prunes_this_runs(tmp_path):
    with one_rank_group():
        train(compose("run.steps=6", "run.checkpoint_every=2", "run.keep_checkpoints=2"),
              tmp_path / "r")
        kept = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
        assert kept == ["step_4", "step_6"]
        out = train(compose("run.steps=2", "run.resume=false", "run.existing_checkpoints=move"),
                    tmp_path / "r")
    assert out["step"] == 2
    assert not (tmp_path / "r" / "checkpoints").exists()  # this run saved none
