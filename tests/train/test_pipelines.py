"""Every pipeline of the config group trains the app's model, ROBE-Z and full tables
(in-process, 1 rank); the pipeline gets the dense optimizer only, as FusedSparseDist and
SemiSync require."""

from __future__ import annotations

import math

import pytest

from robe_torchrec.train.config import ConfigError
from robe_torchrec.train.trainer import train
from tests.train.helpers import compose, one_rank_group


@pytest.mark.slow
@pytest.mark.parametrize("embedding", ["robe", "full"])
@pytest.mark.parametrize("pipeline", ["plain", "sparse_dist", "fused_sparse_dist", "semi_sync"])
def test_every_pipeline_trains(tmp_path, pipeline, embedding):
    # semi_sync from its first batch on, so the run is really semi-synchronous
    extra = ["pipeline.options.start_batch=1"] if pipeline == "semi_sync" else []
    with one_rank_group():
        out = train(compose(f"pipeline={pipeline}", f"embedding={embedding}", "run.steps=4",
                            *extra), tmp_path)
    assert out["step"] == 4
    assert math.isfinite(out["test_log_loss"]) and 0.0 <= out["test_auc"] <= 1.0


def test_unknown_pipeline_option_is_a_config_error(tmp_path):
    with one_rank_group(), pytest.raises(ConfigError, match="pipeline=plain"):
        train(compose("pipeline=plain", "+pipeline.options.turbo=true", "run.steps=1"), tmp_path)


def test_semi_sync_with_stash_and_checkpoints_warns_resume_is_not_exact(tmp_path, caplog):
    with one_rank_group(), caplog.at_level("WARNING"):
        train(compose("pipeline=semi_sync", "pipeline.options.stash_gradients=true",
                      "run.steps=2", "run.checkpoint_every=2", "run.test_batches=1",
                      "run.eval_batches=1"), tmp_path)
    assert "stash_gradients: a checkpoint does not hold the stashed dense gradient" in caplog.text
