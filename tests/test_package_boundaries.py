"""Package boundaries: the pipelines (folder ``pipelines/``, installed as
``robe_torchrec.pipelines``) depend on TorchRec and the ``robe_torchrec`` core, never on the
training app ``robe_torchrec.train`` (the app depends on the pipelines); the installed
packages never import the top-level ``benchmarks``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
APP = "robe_torchrec.train"


def imports(path: Path) -> List[str]:
    """Every module (or module attribute) the file ``path`` imports."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    return imported(path.read_text(), package)


def imported(source: str, package: str) -> List[str]:
    """Every ``a.b`` and ``a.b.name`` that ``source``, a module of ``package``, imports
    (relative imports resolved), at any depth (functions included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found


def _is(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offenders(package: str, forbidden: str, skip: str = "") -> List[str]:
    """``file: module`` for every import of ``forbidden`` by a file of ``package`` (files
    under ``skip`` left out)."""
    return [f"{path.relative_to(ROOT)}: {m}" for path in sorted((ROOT / package).rglob("*.py"))
            if not (skip and _is(".".join(path.relative_to(ROOT).parts), skip))
            for m in imports(path) if _is(m, forbidden)]


def test_pipelines_do_not_import_the_app():
    assert offenders("pipelines", APP) == []


def test_nothing_imports_a_top_level_pipelines_package():
    """The folder installs as ``robe_torchrec.pipelines``; ``import pipelines`` would only
    work by accident, from the repository root."""
    folders = ("robe_torchrec", "pipelines", "benchmarks", "examples", "tests")
    assert [o for f in folders for o in offenders(f, "pipelines")] == []


def test_core_does_not_import_the_app():
    assert offenders("robe_torchrec", APP, skip=APP) == []


def test_installed_packages_do_not_import_benchmarks():
    assert offenders("robe_torchrec", "benchmarks") + offenders("pipelines", "benchmarks") == []


def test_importing_pipelines_loads_no_app_module():
    """At run time too (an import inside a function, or one made by a dependency)."""
    code = ("import sys, robe_torchrec.pipelines, robe_torchrec.pipelines.compare, robe_torchrec.pipelines.model\n"
            f"print(sorted(m for m in sys.modules if m == {APP!r} or "
            f"m.startswith({APP + '.'!r})))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_check_sees_every_kind_of_import():
    source = ("import robe_torchrec.train.app\n"
              "def f():\n"
              "    from ..train import trainer\n"
              "    from . import model\n")
    found = imported(source, "robe_torchrec.data")
    assert "robe_torchrec.train.app" in found
    assert "robe_torchrec.train.trainer" in found and "robe_torchrec.data.model" in found
    assert [m for m in imported("import benchmarks.cpu_ops", "pipelines")
            if _is(m, "benchmarks")] == ["benchmarks.cpu_ops"]


def test_benchmarks_import_no_tests():
    """Checks shared by both live in the library (``robe_torchrec.testing``)."""
    assert offenders("benchmarks", "tests") == []
    assert offenders("robe_torchrec", "tests") + offenders("pipelines", "tests") == []


def private_writes(source: str) -> List[str]:
    """``line: target`` for every write of a ``_private`` attribute of something ``source``
    imports (a module, or a name from one): an assignment (plain, augmented, annotated, or
    deleting it), ``setattr``, or ``mock.patch.object`` / ``mock.patch("a.b._c")``. Attributes
    of ``self`` and of objects the file makes itself are its own business."""
    tree = ast.parse(source)
    imported = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}

    def root(node: ast.AST) -> str:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else ""

    def private(node: ast.AST, attr: object) -> bool:  # a name made at run time may be one
        return (not isinstance(attr, str) or attr.startswith("_")) and root(node) in imported

    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [f"{node.lineno}: {ast.unparse(t)}" for t in targets
                  if isinstance(t, ast.Attribute) and private(t.value, t.attr)]
        if not isinstance(node, ast.Call):
            continue
        name, args = ast.unparse(node.func), node.args
        attr = (args[1].value if isinstance(args[1], ast.Constant) else None) \
            if len(args) > 1 else ""
        if (name in ("setattr", "delattr") or name.endswith("patch.object")) and len(args) > 1 \
                and private(args[0], attr):
            found.append(f"{node.lineno}: {name}({ast.unparse(args[0])}, {ast.unparse(args[1])})")
        if name.endswith("patch") and args and isinstance(args[0], ast.Constant) \
                and str(args[0].value).rsplit(".", 1)[-1].startswith("_"):
            found.append(f"{node.lineno}: {name}({args[0].value!r})")
    return found


def test_benchmarks_and_pipelines_write_no_private_attribute_of_another_module():
    """They reach the library through its public seams (``robe_torchrec.ops.tuning``,
    ``triton_kernels.stubbed_launches``), never by patching what it keeps to itself."""
    offending = [f"{path.relative_to(ROOT)}:{hit}" for folder in ("benchmarks", "pipelines")
                 for path in sorted((ROOT / folder).rglob("*.py"))
                 for hit in private_writes(path.read_text())]
    assert offending == []


def test_the_private_write_check_sees_every_kind_of_write():
    source = ("import unittest.mock\n"
              "from robe_torchrec.ops import triton_kernels as tk\n"
              "import robe_torchrec.ops\n"
              "tk._counts_in_kernel = None\n"
              "robe_torchrec.ops._PLAIN_KEYS += 1\n"
              "setattr(tk, '_summarize_inputs', None)\n"
              "with unittest.mock.patch.object(tk, '_kernels_for', None): pass\n"
              "with unittest.mock.patch('robe_torchrec.ops.cpu._SOURCES', []): pass\n"
              "class Mine:\n"
              "    def f(self):\n"
              "        self._x = 1\n"
              "        local = Mine()\n"
              "        local._y = 2\n"
              "        tk.public = 3\n"
              "        setattr(tk, 'public', 4)\n"
              "        for name in ('a', '_b'):\n"
              "            setattr(tk, name, 5)\n")
    assert [hit.split(":")[0] for hit in private_writes(source)] == ["4", "5", "6", "7", "8", "17"]
