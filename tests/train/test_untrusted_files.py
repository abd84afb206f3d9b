"""Files from elsewhere run no code (docs/reliability.md, threat model): a checkpoint whose
DCP ``.metadata`` pickle carries a payload, with a manifest vouching for it, on resume, in
eval mode and through ``embedding.init_from``; and ``.pt2`` programs loaded with
``robe_torchrec.export.load_program``. Each payload would create a marker file; none may."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from robe_torchrec.export import UnsafeProgramError, export_model, load_program
from robe_torchrec.train.checkpoint import (MANIFEST, CheckpointError, read_metadata_safely,
                                            verify_checkpoint)
from robe_torchrec.train.data import build_data
from robe_torchrec.train.model import build_model
from robe_torchrec.train.trainer import Trainer, evaluate, train
from tests.train.helpers import compose, one_rank_group


class _Payload:
    """Unpickled, it would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(ckpt: Path, marker: Path, manifest: bool = True) -> Path:
    """Make ``ckpt`` a checkpoint whose .metadata is the payload, with a manifest whose
    checksums match (whoever supplies a checkpoint can write its manifest too)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    data = pickle.dumps(_Payload(marker))
    (ckpt / ".metadata").write_bytes(data)
    if manifest:
        (ckpt / MANIFEST).write_text(json.dumps({
            "run_id": "attacker0000", "step": 999, "world_size": 1,
            "files": {".metadata": hashlib.sha256(data).hexdigest()}}))
    return ckpt / ".metadata"


@pytest.fixture(scope="session")  # see tests/conftest.py: built once per worker
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("untrusted") / "run"
    with one_rank_group():
        train(compose("run.steps=2", "run.checkpoint_every=2"), run_dir)
    return run_dir


def test_the_restricted_unpickler_reads_the_apps_checkpoints(trained):
    metadata = read_metadata_safely(trained / "checkpoints" / "step_2")
    assert any(k.startswith("model.") for k in metadata.state_dict_metadata)
    assert verify_checkpoint(trained / "checkpoints" / "step_2") is None


def test_resume_never_runs_a_planted_step(trained, tmp_path, caplog):
    """A new step_999 holding only the payload (and a matching manifest): it is refused
    as unusable, named, set aside, and the run resumes from the real step_2."""
    run_dir = Path(shutil.copytree(trained, tmp_path / "run"))
    marker = tmp_path / "ran"
    planted = _plant(run_dir / "checkpoints" / "step_999", marker)
    with one_rank_group(), caplog.at_level(logging.WARNING):
        trainer = Trainer(compose("run.steps=1000", "run.checkpoint_every=2"), run_dir)
        try:
            trainer.build()
            trainer.resume()
        finally:
            trainer.close()
    assert not marker.exists()
    assert trainer.step == 2
    assert f"{planted}: refused, not unpickled: it names posix.system" in caplog.text
    assert (run_dir / "checkpoints" / "step_999.bad").is_dir()


def test_eval_never_runs_a_planted_checkpoint(tmp_path):
    marker = tmp_path / "ran"
    planted = _plant(tmp_path / "evil" / "step_999", marker)
    with one_rank_group(), pytest.raises(CheckpointError, match=re.escape(str(planted))):
        evaluate(compose("run.mode=eval", f"run.checkpoint={planted.parent}"), tmp_path / "e")
    assert not marker.exists()


@pytest.mark.parametrize("manifest", [True, False])
def test_init_from_never_runs_a_planted_checkpoint(tmp_path, manifest):
    """With a manifest the metadata is refused unread; without one the checkpoint is
    refused before anything is read (run.allow_unverified=true would read it, safely)."""
    marker = tmp_path / "ran"
    planted = _plant(tmp_path / "evil" / "step_2", marker, manifest=manifest)
    cfg = compose(f"embedding.init_from={planted.parent}")
    data = build_data(cfg, 0, 1)
    named = str(planted) if manifest else f"{planted.parent}.*has no {MANIFEST}"
    with pytest.raises(CheckpointError, match=named):
        build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
    cfg = compose(f"embedding.init_from={planted.parent}", "run.allow_unverified=true")
    with pytest.raises(CheckpointError, match=re.escape(str(planted))):
        build_model(cfg, data.keys, data.cardinalities, torch.device("cpu"))
    assert not marker.exists()


# ---------------------------------------------------------------- exported programs

@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """A small exported DLRM over ROBE-Z, as ``run.export`` writes one."""
    from torchrec import KeyedJaggedTensor

    from robe_torchrec.config import RobeConfig
    from robe_torchrec.data.synthetic import SyntheticCriteo
    from robe_torchrec.dlrm import DLRMSpec, build_predict_model

    data = SyntheticCriteo(batch_size=8, cardinality_scale=0.001, num_sparse=3)
    spec = DLRMSpec(robe=RobeConfig(compression=100, block_size=8), embedding_dim=8,
                    dense_arch=(8,), over_arch=(8, 1))
    torch.manual_seed(0)
    model, _ = build_predict_model(spec, data.keys, data.cardinalities)
    batch = data.batch(0)
    sparse = batch.sparse_features
    kjt = KeyedJaggedTensor(keys=sparse.keys(), values=sparse.values(), lengths=sparse.lengths())
    path = tmp_path_factory.mktemp("program") / "dlrm.pt2"
    torch.export.save(export_model(model.eval(), batch.dense_features, kjt), path)
    return path


def _rewrite(src: Path, dst: Path, suffix: str, change) -> Path:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, change(data) if info.filename.endswith(suffix) else data)
    return dst


def test_load_program_loads_what_the_app_exports(program):
    loaded = load_program(program)
    (dense, kjt), _ = loaded.example_inputs
    with torch.no_grad():
        assert loaded.module()(dense, kjt).shape == (dense.shape[0], 1)


def test_load_program_never_unpickles_a_replaced_sample_input(program, tmp_path):
    """torch.export.load itself falls back to a full unpickle here, and the payload runs
    (checked first, so that this test shows the hole it guards)."""
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    evil = _rewrite(program, tmp_path / "evil.pt2", "sample_inputs/model.pt",
                    lambda _: buf.getvalue())
    with pytest.raises(UnsafeProgramError, match=re.escape(str(evil)) + r".*sample_inputs/"
                       r"model.pt does not load with weights_only=True.*posix.system"):
        load_program(evil)
    assert not marker.exists()
    try:
        torch.export.load(evil)
    except Exception:  # noqa: BLE001 - only whether the payload ran matters
        pass
    assert marker.exists(), "torch.export.load no longer falls back: simplify load_program"


def test_load_program_never_evaluates_a_crafted_shape_expression(program, tmp_path):
    """torch parses shape expressions with sympy.sympify, which evaluates Python."""
    marker = tmp_path / "ran"
    payload = f"__import__('os').system('touch {marker}') + "

    def inject(data: bytes) -> bytes:
        doc = json.loads(data)
        done = []

        def walk(obj):
            if isinstance(obj, dict):
                for k, v in obj.items():
                    if k == "expr_str" and not done:
                        obj[k] = payload + v
                        done.append(k)
                    else:
                        walk(v)
            elif isinstance(obj, list):
                for v in obj:
                    walk(v)

        walk(doc)
        assert done
        return json.dumps(doc).encode()

    evil = _rewrite(program, tmp_path / "evil.pt2", "models/model.json", inject)
    with pytest.raises(UnsafeProgramError, match=r"models/model.json holds the shape "
                                                 r"expression .*__import__"):
        load_program(evil)
    assert not marker.exists()
