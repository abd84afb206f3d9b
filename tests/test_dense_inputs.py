"""The model owns its dense-input width (``DLRMSpec.dense_in_features``, Criteo's 13 by
default) and the data owns the format's (``robe_torchrec.data.criteo.NUM_DENSE``, defined
once): the model builder does not import the data package for it, and the two agree."""

from __future__ import annotations

import ast

import pytest

from robe_torchrec.config import RobeConfig
from robe_torchrec.data import criteo
from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.dlrm import DLRMSpec, build_predict_model
from tests.test_import_cycles import ROOT, import_graph


def test_the_default_fits_every_data_source():
    data = SyntheticCriteo(batch_size=4)
    assert DLRMSpec().dense_in_features == criteo.NUM_DENSE == data.num_dense == 13
    assert data.batch(0).dense_features.shape == (4, data.num_dense)


def test_the_model_builder_does_not_import_the_data():
    graph = import_graph()
    assert [m for m in graph["robe_torchrec.dlrm"] if m.startswith("robe_torchrec.data")] == []


def test_the_format_constant_is_defined_once():
    defined = []
    for path in sorted((ROOT / "robe_torchrec").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == "NUM_DENSE" for t in targets):
                defined.append(str(path.relative_to(ROOT)))
    assert defined == ["robe_torchrec/data/criteo.py"]


def test_a_spec_builds_a_model_of_its_width():
    spec = DLRMSpec(robe=RobeConfig(compression=10, block_size=4), embedding_dim=8,
                    dense_arch=(8,), over_arch=(8, 1), dense_in_features=5)
    data = SyntheticCriteo(batch_size=4, num_sparse=2)
    model, _ = build_predict_model(spec, data.keys, data.cardinalities)
    batch = data.batch(0)
    assert model(batch.dense_features[:, :5], batch.sparse_features).shape == (4, 1)
    with pytest.raises(RuntimeError):  # 13 features into a model of 5
        model(batch.dense_features, batch.sparse_features)
    assert DLRMSpec.from_dict({"dense_in_features": 5}).dense_in_features == 5
    with pytest.raises(ValueError, match="dense_in_features must be >= 1"):
        DLRMSpec(dense_in_features=0)
