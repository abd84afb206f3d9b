"""From a trained checkpoint to a served model: ``run.mode=eval`` scores a checkpoint written
by 2 ranks in one process, and ``run.export`` writes a ``torch.export`` program that a fresh
process (torch, torchrec and robe_torchrec only) runs to the app's eval outputs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from robe_torchrec.train.checkpoint import load_unsharded
from robe_torchrec.train.config import ConfigError, validate
from robe_torchrec.train.data import build_data
from robe_torchrec.train.model import build_predict_model
from robe_torchrec.train.trainer import run as run_app
from tests.train.helpers import REPO, TINY, VENV_BIN, compose, one_rank_group, run, torchrun

# one array per table, planned table-wise: each of the 2 ranks saves only its tables
TWO_RANK_MODEL = ["embedding.shared=false", "sharding=table_wise"]
STEPS = 4


def predictions(path: Path) -> np.ndarray:
    return np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)


def test_mode_and_checkpoint_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="run.mode: unknown value 'serve'; choose one of "
                                          "train, eval"):
        validate(compose("run.mode=serve"))
    with pytest.raises(ConfigError, match="needs run.checkpoint"):
        validate(compose("run.mode=eval"))
    with pytest.raises(ConfigError, match="no complete checkpoint at"):
        validate(compose("run.mode=eval", f"run.checkpoint={tmp_path}"))
    with pytest.raises(ConfigError, match="read by run.mode=eval only"):
        validate(compose(f"run.checkpoint={tmp_path}"))
    with pytest.raises(ConfigError, match="run.predictions=true needs run.mode=eval"):
        validate(compose("run.predictions=true"))


@pytest.mark.slow
def test_eval_of_a_checkpoint_repeats_the_runs_final_metrics(tmp_path):
    with one_rank_group():
        trained = run_app(compose(f"run.steps={STEPS}", f"run.checkpoint_every={STEPS}"),
                          tmp_path / "train")
        ckpt = tmp_path / "train" / "checkpoints" / f"step_{STEPS}"
        scored = run_app(compose("run.mode=eval", f"run.checkpoint={ckpt}",
                                 "run.predictions=true"), tmp_path / "eval")
    assert scored["step"] == STEPS
    for key in ("val_auc", "val_log_loss", "test_auc", "test_log_loss"):
        assert scored[key] == trained[key], key
    assert not (tmp_path / "eval" / "checkpoints").exists()  # eval writes no checkpoint
    assert predictions(tmp_path / "eval" / "predictions_val.csv").shape == (32, 2)  # 1 batch


@pytest.fixture(scope="session")  # see tests/conftest.py: built once per worker
def two_rank_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint written by 2 ranks (torchrun) of ROBE-Z tables planned table-wise."""
    root = tmp_path_factory.mktemp("two_ranks")
    done = run(torchrun(2, *TINY, f"run.steps={STEPS}", f"run.checkpoint_every={STEPS}",
                        *TWO_RANK_MODEL, f"hydra.run.dir={root / 'train'}"), root, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:]
    return root / "train" / "checkpoints" / f"step_{STEPS}"


def app(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m robe_torchrec.train`` in one plain process."""
    return run([str(VENV_BIN / "python"), "-m", "robe_torchrec.train", *TINY, *overrides], cwd,
               timeout=400)


@pytest.mark.slow
def test_eval_loads_a_two_rank_checkpoint_in_one_process(two_rank_checkpoint, tmp_path):
    out = tmp_path / "eval"
    done = app(tmp_path, "run.mode=eval", f"run.checkpoint={two_rank_checkpoint}",
               "run.predictions=true", *TWO_RANK_MODEL, f"hydra.run.dir={out}")
    assert done.returncode == 0, done.stdout[-4000:]
    assert f"(step {STEPS})" in done.stdout
    assert "val log loss" in done.stdout and "test log loss" in done.stdout
    scored = predictions(out / "predictions_val.csv")

    # the same weights read independently, into the unsharded predict model
    cfg = compose(*TWO_RANK_MODEL)
    data = build_data(cfg, 0, 1)
    model, _ = build_predict_model(cfg, data.keys, data.cardinalities)
    assert load_unsharded(two_rank_checkpoint, model) == STEPS
    batch = next(iter(data.eval_batches("val", 1)))
    with torch.no_grad():
        logits = model.eval()(batch.dense_features, batch.sparse_features).reshape(-1)
    np.testing.assert_allclose(scored[:, 0], logits.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(scored[:, 1], batch.labels.numpy())


FRESH = textwrap.dedent("""
    import sys
    import numpy as np
    import torch, torchrec
    import robe_torchrec  # registers the robe ops the program calls

    program = torch.export.load(sys.argv[1])
    (dense, kjt), _ = program.example_inputs  # the first validation batch
    with torch.no_grad():
        logits = program.module()(dense, kjt).reshape(-1).numpy()
    expected = np.loadtxt(sys.argv[2], delimiter=",", skiprows=1, ndmin=2)[: len(logits), 0]
    print("max abs difference", np.abs(logits - expected).max())
    assert np.abs(logits - expected).max() <= 1e-6

    # the batch size is dynamic: the example's first 3 samples
    lengths = kjt.lengths().view(len(kjt.keys()), -1)
    kept = torch.zeros(lengths.shape, dtype=torch.bool)
    kept[:, :3] = True
    small = torchrec.KeyedJaggedTensor(
        keys=kjt.keys(), lengths=lengths[:, :3].reshape(-1),
        values=kjt.values()[torch.repeat_interleave(kept.reshape(-1), kjt.lengths())])
    with torch.no_grad():
        part = program.module()(dense[:3], small).reshape(-1).numpy()
    assert part.shape == (3,) and np.abs(part - expected[:3]).max() <= 1e-6
    print("ok")
""")


def check_in_fresh_process(program: Path, predictions_csv: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", FRESH, str(program), str(predictions_csv)],
                          cwd=program.parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.slow
def test_export_after_training_full_tables(tmp_path):
    """TorchRec's full tables: training exports at its end; eval mode scores the same
    batches, and the program loaded elsewhere gives the same logits."""
    full = ["embedding=full"]
    program = tmp_path / "dlrm.pt2"
    with one_rank_group():
        run_app(compose(f"run.steps={STEPS}", f"run.export={program}", *full), tmp_path / "train")
        ckpt = tmp_path / "train" / "checkpoints" / f"step_{STEPS}"  # saved for the export
        run_app(compose("run.mode=eval", f"run.checkpoint={ckpt}", "run.predictions=true",
                        *full), tmp_path / "eval")
    check_in_fresh_process(program, tmp_path / "eval" / "predictions_val.csv")


@pytest.mark.slow
def test_export_from_a_two_rank_checkpoint_in_eval_mode(two_rank_checkpoint, tmp_path):
    """ROBE-Z: needs the host-sync-free forward (torch.export stopped at
    GuardOnDataDependentSymNode in the module's input checks before it)."""
    out, program = tmp_path / "eval", tmp_path / "dlrm.pt2"
    done = app(tmp_path, "run.mode=eval", f"run.checkpoint={two_rank_checkpoint}",
               "run.predictions=true", f"run.export={program}", *TWO_RANK_MODEL,
               f"hydra.run.dir={out}")
    assert done.returncode == 0, done.stdout[-4000:]
    check_in_fresh_process(program, out / "predictions_val.csv")
