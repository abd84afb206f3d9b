"""Module boundaries: ``robe_torchrec.distributed`` reads other objects through their public
interface only (the module's ``layout`` and methods), never their private attributes.

Parsed with ``ast``: any ``X._name`` (load or store) where ``X`` is not ``self``, ``cls`` or
``super()`` fails, except the attributes listed in ``ALLOWED`` (each with its reason); any
``from robe_torchrec... import _name`` fails.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List

import pytest

import robe_torchrec.distributed

PACKAGE_DIR = pathlib.Path(robe_torchrec.distributed.__file__).parent

#: private attributes of other libraries' objects that TorchRec / PyTorch offer no public
#: access to; every entry says why it is read
ALLOWED = {
    # TorchRec's in-backward optimizer protocol: apply_optimizer_in_backward records the
    # optimizer on the parameter under these names, and in_backward_optimizer_filter and the
    # planner read them there
    "_optimizer_classes": "TorchRec in-backward optimizer protocol (planner reads it)",
    "_in_backward_optimizers": "TorchRec in-backward optimizer protocol (keeps the array "
                               "away from dense optimizers)",
    # the only constructor of a ShardedTensor from local shards plus a global metadata that
    # does not run a collective (init_from_local_shards all-gathers the metadata)
    "_init_from_local_shards_and_global_metadata": "ShardedTensor constructor without a "
                                                   "collective",
    # TorchRec's FeatureProcessedEmbeddingBagCollection keeps the collection it wraps here,
    # with no accessor; TorchRec's own sharder of it reads the attribute too
    "_embedding_bag_collection": "the collection an FP-EBC wraps (fp_sharder.inner_collection)",
}


def _is_self_like(node: ast.expr) -> bool:
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def private_reads(source: str, filename: str = "<source>") -> List[str]:
    """Every private attribute access and private import of ``source``, as messages."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute):
            name = node.attr
            if (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                    and not _is_self_like(node.value) and name not in ALLOWED):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("robe_torchrec"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import "
                                 f"{alias.name}")
    return found


def _sources():
    return sorted(PACKAGE_DIR.rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_distributed_reads_no_private_attribute(path):
    assert private_reads(path.read_text(), str(path)) == []


def test_the_check_finds_private_reads():
    source = ("from robe_torchrec.embedding_bag import _hidden\n"
              "def f(module, self):\n"
              "    self._mine = module._robe.shared\n"
              "    super()._load(module.__dict__)\n"
              "    module.weight._optimizer_classes = None\n")
    found = private_reads(source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "from robe_torchrec.embedding_bag import _hidden", "module._robe"]
