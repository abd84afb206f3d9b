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
