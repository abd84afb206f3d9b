"""``robe_torchrec.install()`` owns every change robe_torchrec makes to TorchRec's and torch's
behaviour: importing the package makes them all, a second call changes nothing, the result
names them, no other module changes anything when imported, and without torchrec there is
nothing to change and the ops still import."""

from __future__ import annotations

import ast
import doctest
import importlib
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch
import torchrec.optim
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed import model_parallel
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import robe_torchrec
from robe_torchrec import installation, quiet
from robe_torchrec.installation import CHANGES
from robe_torchrec.torchrec_compat import SHARD_IMPLEMENTATIONS
from tests.ops.test_torch_only import HIDE_TORCHREC

ROOT = Path(__file__).resolve().parents[1]

#: the functions that change TorchRec or torch; only robe_torchrec.install() may call them
INSTALLERS = {"install", "install_rowwise_adagrad", "allow_kjt_in_saved_programs",
              "install_default_sharder", "install_dmp_check", "install_ddp_check",
              "install_shard_check",
              "install_fp_sharder_check"}


def _patched_state() -> Dict[str, Any]:
    """Every object the changes replace or extend, as it is now (compared by identity)."""
    shard_module = importlib.import_module("torchrec.distributed.shard")
    loggers = {name for name, _ in quiet.NOISE_RECORDS}
    return {
        "RowWiseAdagrad.__init__": torchrec.optim.RowWiseAdagrad.__init__,
        "RowWiseAdagrad.step": torchrec.optim.RowWiseAdagrad.step,
        "safe globals": sorted(map(repr, torch.serialization.get_safe_globals())),
        "model_parallel.get_default_sharders": model_parallel.get_default_sharders,
        "shard.get_default_sharders": shard_module.get_default_sharders,
        "DistributedModelParallel.__init__": DistributedModelParallel.__init__,
        "DistributedDataParallel.__new__": DistributedDataParallel.__new__,
        **{f"FeatureProcessedEmbeddingBagCollectionSharder.{name}":
           getattr(FeatureProcessedEmbeddingBagCollectionSharder, name)
           for name in ("shardable_parameters", "shard")},
        **{f"shard.{name}": getattr(shard_module, name) for name in SHARD_IMPLEMENTATIONS},
        "warnings filters": list(warnings.filters),
        **{f"logger {name}": list(logging.getLogger(None if name == "root" else name).filters)
           for name in loggers},
    }


def test_import_made_every_change_and_install_names_them():
    names = robe_torchrec.install()
    assert names == tuple(CHANGES)
    assert all(isinstance(n, str) and n.isidentifier() and len(n) <= 24 for n in names), names
    assert robe_torchrec.install is installation.install
    # the import made them: the wrapped objects carry their originals, once
    state = _patched_state()
    wrapped = [k for k in state if k.endswith(("__init__", "__new__", "step",
                                               "get_default_sharders"))
               or k.startswith(("shard._", "FeatureProcessed"))]
    for key in wrapped:
        assert hasattr(state[key], "robe_wraps"), key
        assert not hasattr(state[key].robe_wraps, "robe_wraps"), f"{key} wrapped twice"
    assert repr(KeyedJaggedTensor) in state["safe globals"]
    assert quiet.installed()


def test_a_second_install_changes_nothing():
    before = _patched_state()
    assert robe_torchrec.install() == robe_torchrec.install()
    after = _patched_state()
    changed = [key for key in before if before[key] != after[key]]
    assert changed == [], changed


def test_the_module_docstring_example_runs():
    result = doctest.testmod(installation, optionflags=doctest.ELLIPSIS
                             | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3 and result.failed == 0, result


def _import_time_changes(source: str, label: str) -> List[str]:
    """The statements of ``source`` (named ``label``) that run on import (its top level, top-level ``if`` /
    ``try`` blocks included) and change something outside it: an installer call, a
    ``setattr`` or an assignment to another object's attribute."""
    found: List[str] = []

    def visit(statements: List[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", [])
                      + [s for h in getattr(node, "handlers", []) for s in h.body])
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    func = sub.func
                    name = (func.attr if isinstance(func, ast.Attribute)
                            else getattr(func, "id", ""))
                    if name in INSTALLERS or name == "setattr":
                        found.append(f"{label}:{sub.lineno}: {ast.unparse(sub)}")
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                       else [])
            for target in targets:
                if isinstance(target, ast.Attribute):
                    found.append(f"{label}:{node.lineno}: {ast.unparse(node)}")

    visit(ast.parse(source, label).body)
    return found


def test_no_module_changes_anything_when_imported():
    allowed = {"robe_torchrec/__init__.py:"}  # calls install(), the one place
    sources = sorted((ROOT / "robe_torchrec").rglob("*.py")) + sorted((ROOT / "pipelines")
                                                                      .rglob("*.py"))
    found = [f for path in sources
             for f in _import_time_changes(path.read_text(), str(path.relative_to(ROOT)))
             if not f.startswith(tuple(allowed))]
    assert found == [], found
    init = ROOT / "robe_torchrec" / "__init__.py"
    top = _import_time_changes(init.read_text(), "__init__.py")
    assert [f.split(": ", 1)[1] for f in top] == ["install()"], top


def test_the_check_sees_import_time_changes():
    source = ("import torchrec\n"
              "from x import install_dmp_check\n"
              "def f():\n    install_dmp_check()\n"          # at run time: allowed
              "class C:\n    def g(self):\n        self.x = 1\n"
              "try:\n    install_dmp_check()\nexcept ImportError:\n    pass\n"
              "torchrec.optim.X = 1\n"
              "setattr(torchrec, 'y', 2)\n"
              "value = 3\n")
    found = [f.split(": ", 1)[1] for f in _import_time_changes(source, "probe.py")]
    assert found == ["install_dmp_check()", "torchrec.optim.X = 1",
                     "setattr(torchrec, 'y', 2)"], found


_WITHOUT_TORCHREC = HIDE_TORCHREC + r"""
import robe_torchrec
import robe_torchrec.ops
print("install:", robe_torchrec.install())
"""


def test_install_without_torchrec_changes_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCHREC], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "install: ()", out.stdout
