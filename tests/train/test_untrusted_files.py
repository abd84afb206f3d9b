"""Files from elsewhere run no code (docs/reliability.md, threat model): a checkpoint whose
DCP ``.metadata`` pickle carries a payload, with a manifest vouching for it, on resume, in
eval mode and through ``embedding.init_from``; and ``.pt2`` programs loaded with
``robe_torchrec.export.load_program``. Each payload would create a marker file; none may."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import operator
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
from robe_torchrec.train.model import build_model, build_predict_model
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


def _resumed(run_dir: Path) -> Trainer:
    """A trainer of the run in ``run_dir``, resumed (from the newest usable checkpoint)."""
    with one_rank_group():
        trainer = Trainer(compose("run.steps=1000", "run.checkpoint_every=2"), run_dir)
        try:
            trainer.build()
            trainer.resume()
        finally:
            trainer.close()
    return trainer


def test_resume_never_runs_a_planted_step(trained, tmp_path, caplog):
    """A new step_999 holding only the payload (and a matching manifest): it is refused
    as unusable, named, set aside, and the run resumes from the real step_2."""
    run_dir = Path(shutil.copytree(trained, tmp_path / "run"))
    marker = tmp_path / "ran"
    planted = _plant(run_dir / "checkpoints" / "step_999", marker)
    with caplog.at_level(logging.WARNING):
        trainer = _resumed(run_dir)
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


def _write_manifest(ckpt: Path) -> None:
    """A manifest whose checksums match whatever ``ckpt`` now holds."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in ckpt.iterdir() if p.name != MANIFEST}
    (ckpt / MANIFEST).write_text(json.dumps({"run_id": "attacker0000", "step": 999,
                                             "world_size": 1, "files": files}))


def _plant_entry(ckpt: Path, marker: Path, key: str) -> None:
    """Point ``key`` of checkpoint ``ckpt`` at a new file holding a payload, as a non-tensor
    entry, which DCP itself reads back with a full unpickle; its metadata names only DCP's
    classes, and its manifest matches."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = read_metadata_safely(ckpt)
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    (ckpt / "evil.distcp").write_bytes(buf.getvalue())
    metadata.state_dict_metadata[key] = md.BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != key}
    metadata.storage_data[md.MetadataIndex(key)] = _StorageInfo("evil.distcp", 0,
                                                                len(buf.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _write_manifest(ckpt)


def test_resume_never_unpickles_a_planted_entry(trained, tmp_path, caplog):
    """Metadata of DCP's classes only, but the step entry is a payload DCP would read with
    a full unpickle: refused by the weights-only read, set aside, resumed from before."""
    run_dir = Path(shutil.copytree(trained, tmp_path / "run"))
    marker = tmp_path / "ran"
    planted = Path(shutil.copytree(run_dir / "checkpoints" / "step_2",
                                   run_dir / "checkpoints" / "step_999"))
    _plant_entry(planted, marker, "trainer.step")
    assert verify_checkpoint(planted) is None  # the manifest vouches for it
    with caplog.at_level(logging.WARNING):
        trainer = _resumed(run_dir)
    assert not marker.exists()
    assert trainer.step == 2
    assert "'trainer.step' does not load with weights_only=True" in caplog.text
    assert "posix.system" in caplog.text
    assert (run_dir / "checkpoints" / "step_999.bad").is_dir()


def test_a_planted_entry_is_refused_by_every_reader(trained, tmp_path):
    """``load_unsharded`` (run.export) and the compression readers (embedding.init_from,
    compress.load_embedding_bag_collection) read no non-tensor entry in full either."""
    from robe_torchrec.compress import load_table_weights
    from robe_torchrec.train.checkpoint import UnsafeCheckpointError, load_unsharded
    from torchrec import EmbeddingBagConfig

    marker = tmp_path / "ran"
    planted = Path(shutil.copytree(trained / "checkpoints" / "step_2", tmp_path / "step_2"))
    _plant_entry(planted, marker, "trainer.step")
    cfg = compose()
    data = build_data(cfg, 0, 1)
    model, _ = build_predict_model(cfg, data.keys, data.cardinalities)
    with pytest.raises(UnsafeCheckpointError, match="'trainer.step' does not load with "
                                                    "weights_only=True.*posix.system"):
        load_unsharded(planted, model)
    # a table given as a non-tensor entry: refused before anything is read
    key = "model.model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
    _plant_entry(planted, marker, key)
    table = EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=3,
                               feature_names=["f0"])
    with pytest.raises(ValueError, match="table 't0'.* is not a tensor entry"):
        load_table_weights(planted, [table], prefix="model.sparse_arch."
                                                    "embedding_bag_collection.embedding_bags.")
    assert not marker.exists()


def test_compress_reads_a_checkpoint_safely_by_default(tmp_path):
    """``compress.load_embedding_bag_collection`` (docs/compress.md) with no reader given:
    the restricted metadata reader, not DCP's full unpickle."""
    from robe_torchrec.compress import load_embedding_bag_collection
    from robe_torchrec.train.checkpoint import UnsafeCheckpointError
    from torchrec import EmbeddingBagConfig

    marker = tmp_path / "ran"
    planted = _plant(tmp_path / "evil", marker)
    table = EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=3,
                               feature_names=["f0"])
    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(planted)) +
                       ": refused, not unpickled: it names posix.system"):
        load_embedding_bag_collection(planted.parent, [table])
    assert not marker.exists()


def test_metadata_may_not_set_attributes_of_a_class(tmp_path):
    """A pickle of DCP's classes only can still set attributes of a class (BUILD on the
    class itself), for the whole process: refused before it does."""
    from torch.distributed.checkpoint import metadata as md

    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    cls = b"\x80\x04ctorch.distributed.checkpoint.metadata\nBytesStorageMetadata\n"
    poke = cls + b"(N}X\x08\x00\x00\x00injectedK\x01stb0"  # BUILD (None, {"injected": 1})
    (ckpt / ".metadata").write_bytes(poke + pickle.dumps(md.Metadata({}))[2:])
    with pytest.raises(CheckpointError, match="refused, not unpickled: it sets attributes "
                                              "of the class BytesStorageMetadata itself"):
        read_metadata_safely(ckpt)
    assert not hasattr(md.BytesStorageMetadata, "injected")


def test_metadata_may_not_point_outside_the_checkpoint(trained, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ckpt = Path(shutil.copytree(trained / "checkpoints" / "step_2", tmp_path / "step_2"))
    metadata = read_metadata_safely(ckpt)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"points DCP at '\.\./\.\./etc/passwd', which "
                                              r"is not a file of the checkpoint's folder"):
        read_metadata_safely(ckpt)


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


def _repack(src: Path, dst: Path, change) -> Path:
    """``src`` written again as ``dst`` with its entries ``change`` d: a function of the
    ``[(name, bytes)]`` list returning the new one (stored as given, duplicates too)."""
    with zipfile.ZipFile(src) as zin:
        entries = [(n, zin.read(n)) for n in zin.namelist()]
    with zipfile.ZipFile(dst, "w") as zout:
        for name, data in change(entries):
            zout.writestr(name, data)
    return dst


def _pickled(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    return buf.getvalue()


def _constants_config(entries):
    return next(n for n, _ in entries if n.endswith("_constants_config.json"))


def _listing(path_name: str, use_pickle: bool = False) -> bytes:
    return json.dumps({"config": {"x": {"path_name": path_name, "is_param": False,
                                        "use_pickle": use_pickle}}}).encode()


def _legacy(entries, marker):
    """torch's pre-2.8 layout, which it falls back to and unpickles in full."""
    program = next(d for n, d in entries if n.endswith("/models/model.json"))
    return [("version", b"8.20"), ("serialized_exported_program.json", program),
            ("serialized_state_dict.pt", _pickled(marker))]


def _opaque(entries, marker):
    """An opaque object, which torch unpickles whatever ``use_pickle`` says."""
    config = _constants_config(entries)
    root = config.split("/", 1)[0]
    return [(n, _listing("opaque_obj_0") if n == config else d) for n, d in entries] + \
        [(f"{root}/data/constants/opaque_obj_0", pickle.dumps(_Payload(marker)))]


def _pickled_constant(entries, marker):
    config = _constants_config(entries)
    root = config.split("/", 1)[0]
    return [(n, _listing("tensor_9", use_pickle=True) if n == config else d)
            for n, d in entries] + [(f"{root}/data/constants/tensor_9", _pickled(marker))]


def _compiled(entries, marker):
    """AOTInductor entries, which torch compiles with the archive's own flags."""
    root = entries[0][0].split("/", 1)[0]
    return entries + [(f"{root}/data/aotinductor/model/m.wrapper.cpp", b"int x;"),
                      (f"{root}/data/aotinductor/model/m_compile_flags.json",
                       json.dumps({"compiler": f"touch {marker}; true"}).encode())]


def _stored_twice(entries, marker):
    """The constants config twice, a pickled one first: Python's zipfile reads the last
    copy, torch's reader the first."""
    config = _constants_config(entries)
    root = config.split("/", 1)[0]
    return [(config, _listing("tensor_9", use_pickle=True)),
            (f"{root}/data/constants/tensor_9", _pickled(marker))] + entries


def _nested_model(entries, marker):
    """A second model named ``a/b``, whose weights torch looks for in the legacy file."""
    root = entries[0][0].split("/", 1)[0]
    program = next(d for n, d in entries if n.endswith("/models/model.json"))
    return entries + [(f"{root}/models/a/b.json", program),
                      (f"{root}/data/weights/a/b.pt", _pickled(marker))]


def _unversioned(entries, marker):
    return [(n, d) for n, d in entries if not n.endswith("/archive_version")]


@pytest.mark.parametrize("change,refusal", [
    (_legacy, r"serialized_\w+\.\w+ is not the one root folder"),
    (_opaque, r"data/constants/opaque_obj_0 is not an entry torch.export.save writes"),
    (_pickled_constant, r"constants_config.json lists 'x' as something other than a raw "
                        r"tensor file"),
    (_compiled, r"data/aotinductor/model/m.wrapper.cpp is not an entry"),
    (_stored_twice, r"constants_config.json is stored twice"),
    (_nested_model, r"models/a/b.json is not an entry"),
    (_unversioned, r"archive_version is missing"),
], ids=["legacy", "opaque", "pickled_constant", "compiled", "stored_twice", "nested_model",
        "unversioned"])
def test_load_program_admits_only_the_layout_torch_export_save_writes(program, tmp_path,
                                                                       change, refusal):
    """Archives torch.export.load would unpickle in full, compile, or read otherwise than
    the checks did: refused by their layout, before anything of them is read."""
    marker = tmp_path / "ran"
    evil = _repack(program, tmp_path / "evil.pt2", lambda entries: change(entries, marker))
    with pytest.raises(UnsafeProgramError, match=re.escape(str(evil)) + ".*" + refusal):
        load_program(evil)
    assert not marker.exists()


def test_torch_export_load_runs_only_with_full_unpickling_refused():
    """The guard around torch.export.load: a path of it the archive checks did not foresee
    reads weights only, or fails, and everything is restored afterwards."""
    from robe_torchrec.safe_program import _full_unpickling_refused

    real = (torch.load, pickle.load, pickle.loads)
    with _full_unpickling_refused("x.pt2"):
        with pytest.raises(UnsafeProgramError, match="x.pt2: refused: loading it asked for "
                                                     "a full unpickle"):
            pickle.loads(pickle.dumps(1))
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            torch.load(io.BytesIO(_pickled(Path("/nonexistent/ran"))), weights_only=False)
    assert (torch.load, pickle.load, pickle.loads) == real


def _edit_program(src: Path, dst: Path, edit) -> Path:
    """``src`` with its ``models/model.json`` rewritten by ``edit`` (on the parsed JSON)."""
    def change(entries):
        out = []
        for name, data in entries:
            if name.endswith("/models/model.json"):
                doc = json.loads(data)
                edit(doc)
                data = json.dumps(doc).encode()
            out.append((name, data))
        return out
    return _repack(src, dst, change)


def _rename(obj, old: str, new: str):
    if isinstance(obj, dict):
        return {(new if k == old else k): _rename(v, old, new) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rename(v, old, new) for v in obj]
    return new if obj == old else obj


def _guard_with_lines(marker):
    """A guard whose comment hides lines from torch's one-line parse of it."""
    def edit(doc):
        doc["guards_code"] = [f"1 #\n, '')\n__import__('os').system('touch {marker}')\n"
                              f"def _(*args):\n  torch._assert(1"]
    return edit


def _guard_calling_torch(marker):
    def edit(doc):
        doc["guards_code"] = [f"torch.os.system('touch {marker}') == 0"]
    return edit


def _input_name_with_code(marker):
    """A graph input named so that FX's generated ``def forward(...)`` evaluates a default
    value when torch builds the program."""
    def edit(doc):
        old = doc["graph_module"]["graph"]["inputs"][0]["as_tensor"]["name"]
        new = f"{old}=__import__('os').system('touch {marker}'), *"
        doc["graph_module"] = _rename(doc["graph_module"], old, new)
    return edit


@pytest.mark.parametrize("edit,refusal", [
    (_guard_with_lines, r"a line break in 'guards_code'"),
    (_guard_calling_torch, r"the guard .*torch.os.system.*which is not a comparison"),
    (_input_name_with_code, r"the name .*__import__"),
], ids=["guard_with_lines", "guard_calling_torch", "input_name_with_code"])
def test_load_program_refuses_what_torch_pastes_into_code(program, tmp_path, edit, refusal):
    """Guards (executed by ``program.module()``) and graph names (pasted into the source
    of FX's ``forward``, executed while the program is built): refused before either."""
    marker = tmp_path / "ran"
    evil = _edit_program(program, tmp_path / "evil.pt2", edit(marker))
    with pytest.raises(UnsafeProgramError, match=re.escape(str(evil)) + ".*" + refusal):
        load_program(evil).module()
    assert not marker.exists()


def test_load_program_hands_torch_the_archive_it_checked(program, tmp_path):
    """Data in front of an archive: Python's zip reader allows for it, torch's does not
    (two readers of one file can see two archives). torch gets the checked entries
    rewritten, so it reads what was checked: here, a program it cannot read alone."""
    prefixed = tmp_path / "prefixed.pt2"
    prefixed.write_bytes(b"\0" * 64 + program.read_bytes())
    with pytest.raises(RuntimeError):
        torch.export.load(prefixed)
    (dense, kjt), _ = load_program(prefixed).example_inputs
    assert dense.dim() == 2


def test_load_program_refuses_a_node_handed_something_to_call(program):
    """A higher-order operator's argument may be something it calls: only operators."""
    from robe_torchrec.safe_program import _check_targets

    loaded = load_program(program)
    graph = loaded.graph_module.graph
    node = next(n for n in graph.nodes if n.op == "call_function")
    node.args = (*node.args, os.system)
    with pytest.raises(UnsafeProgramError, match="calls <built-in function system>"):
        _check_targets(loaded, "x.pt2")


def test_a_checkpoint_file_that_is_a_link_is_refused(trained, tmp_path):
    """DCP opens what a link in a received checkpoint points at: any file."""
    from robe_torchrec.train.checkpoint import UnsafeCheckpointError, load_unsharded

    ckpt = Path(shutil.copytree(trained / "checkpoints" / "step_2", tmp_path / "step_2"))
    victim = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    outside = tmp_path / "outside.distcp"
    victim.rename(outside)
    victim.symlink_to(outside)
    cfg = compose()
    data = build_data(cfg, 0, 1)
    model, _ = build_predict_model(cfg, data.keys, data.cardinalities)
    with pytest.raises(UnsafeCheckpointError, match=re.escape(str(victim)) + " is a link"):
        load_unsharded(ckpt, model)


def test_metadata_may_not_set_attributes_of_a_function(tmp_path):
    """An admitted function keeps state in its attributes (``_get_layout.cache``): a
    pickle may fill in objects of DCP's classes only."""
    from torch.distributed.checkpoint import metadata as md

    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    before = dict(torch.serialization._get_layout.cache)
    poke = (b"\x80\x04ctorch.serialization\n_get_layout\n(N}X\x05\x00\x00\x00cacheX\x04"
            b"\x00\x00\x00boomstb0")  # BUILD (None, {"cache": "boom"}); POP
    (ckpt / ".metadata").write_bytes(poke + pickle.dumps(md.Metadata({}))[2:])
    with pytest.raises(CheckpointError, match="it sets attributes of a function"):
        read_metadata_safely(ckpt)
    assert torch.serialization._get_layout.cache == before


def _sample_inputs_in_a_dict(key: str):
    """The dense example input moved into a dict under ``key``."""
    def change(entries):
        out = []
        for name, data in entries:
            if name.endswith("/data/sample_inputs/model.pt"):
                args, kwargs = torch.load(io.BytesIO(data), weights_only=True)
                buf = io.BytesIO()
                torch.save((({key: args[0]}, *args[1:]), kwargs), buf)
                data = buf.getvalue()
            out.append((name, data))
        return out
    return change


def test_load_program_refuses_input_paths_torch_would_paste_into_code(program, tmp_path):
    """``program.module()`` names each input in a guard's source by its path, dict keys
    included: a key holding a quote would end the string torch writes it into."""
    marker = tmp_path / "ran"
    key = f"x' + str(__import__('os').system('touch {marker}')) + '"
    evil = _repack(program, tmp_path / "evil.pt2", _sample_inputs_in_a_dict(key))
    with pytest.raises(UnsafeProgramError, match="an example input sits at .*__import__"):
        load_program(evil).module()
    assert not marker.exists()
    plain = _repack(program, tmp_path / "plain.pt2", _sample_inputs_in_a_dict("dense"))
    assert isinstance(load_program(plain).example_inputs[0][0], dict)  # a plain key passes


def test_load_program_refuses_a_string_graph_input(program, tmp_path):
    """torch pastes a string input's value, unescaped, into a guard it executes."""
    def edit(doc):
        inputs = doc["graph_module"]["graph"]["inputs"]
        at = next(i for i, given in enumerate(inputs) if "as_none" in given)
        inputs[at] = {"as_string": "x' == 'x' or __import__('os').system('true') or 'x"}
    evil = _edit_program(program, tmp_path / "evil.pt2", edit)
    with pytest.raises(UnsafeProgramError, match=r"a graph input given as \['as_string'\]"):
        load_program(evil)


def test_only_control_flow_higher_order_operators_are_called():
    """``print`` formats any string it is given (a path to any object in the process),
    ``call_torchbind`` and ``flat_apply`` call objects: refused; control flow is not."""
    from robe_torchrec.safe_program import _allowed_call

    higher = torch.ops.higher_order
    assert not _allowed_call(higher.print, set())
    assert _allowed_call(higher.cond, set()) and _allowed_call(torch.ops.aten.add.Tensor, set())


def test_keys_of_the_call_spec_torch_would_paste_into_code_are_refused():
    import types

    import torch.utils._pytree as pytree

    from robe_torchrec.safe_program import _check_inputs

    _, spec = pytree.tree_flatten(((), {"k': 1, 'x": torch.zeros(1)}))
    program = types.SimpleNamespace(example_inputs=((), {}), module_call_graph=[],
                                    call_spec=types.SimpleNamespace(in_spec=spec, out_spec=None))
    with pytest.raises(UnsafeProgramError, match="hold the key \"k': 1, 'x\""):
        _check_inputs(program, "x.pt2")


@pytest.mark.parametrize("target,named", [
    (torch.ops.aten._reshape_alias.default, "aten._reshape_alias"),  # a view past storage
    (torch.ops.aten.empty.memory_format, "aten.empty"),  # memory as it was left
    (operator.attrgetter, "operator.attrgetter"),  # reaches any object
])
def test_load_program_admits_memory_safe_operators_only(program, target, named):
    """A node calling an operator that does not check its bounds (or hands out memory
    as it was left, or reaches any object) would let a program return the process's
    memory: refused, by name."""
    from robe_torchrec.safe_program import _check_targets

    loaded = load_program(program)
    node = next(n for n in loaded.graph_module.graph.nodes if n.op == "call_function")
    node.target = target
    with pytest.raises(UnsafeProgramError, match=f"calls .*{re.escape(named.split('.')[-1])}"
                                                 f".*not one of the memory-safe operators"):
        _check_targets(loaded, "x.pt2")


def test_load_program_refuses_the_meta_device(program):
    """An operator given a meta tensor beside tensors holding data returns memory as it
    was left: a node naming the meta device is refused."""
    from robe_torchrec.safe_program import _check_targets

    loaded = load_program(program)
    node = next(n for n in loaded.graph_module.graph.nodes if n.op == "call_function")
    node.kwargs = {**node.kwargs, "device": torch.device("meta")}
    with pytest.raises(UnsafeProgramError, match="puts a tensor on the meta device"):
        _check_targets(loaded, "x.pt2")
