"""No import cycle among robe_torchrec's modules (``pipelines/`` counted as the installed
``robe_torchrec.pipelines``): every dependency runs one way, so each module can be read, and
imported, after the ones below it. An import inside a function counts: it only hides the
cycle from Python's import order, not from the reader.

A module's own packages are not edges: ``import a.b.c`` runs ``a`` and ``a.b`` first, which
is how packages work, not a dependency of ``c`` on what they hold. ``from a.b import c``
depends on the submodule ``a.b.c`` when there is one, else on ``a.b``'s namespace."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as
PACKAGES = {"robe_torchrec": "robe_torchrec", "pipelines": "robe_torchrec.pipelines"}


def module_files() -> Dict[str, Path]:
    """``{dotted module name: file}`` of every module of the installed package."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, modules: Set[str]) -> Set[str]:
    """The modules of ``modules`` that module ``name`` (file ``path``) imports, at any
    depth of its code (see the module docstring for what counts)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {t for t in targets if t in modules and t != name and t not in ancestors}


def import_graph() -> Dict[str, Set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of ``graph``."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    groups: List[List[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, set(group)) for group in groups]


def _cycle_in(graph: Dict[str, Set[str]], group: Set[str]) -> List[str]:
    """A path from the group's first module back to it, inside the group (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle in the strongly connected group {sorted(group)}")


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, ("import cycles (make the dependency run one way: move the shared piece "
                       "to a lower module):\n" + "\n".join(" -> ".join(c) for c in found))


def test_the_check_sees_the_edges_and_reports_cycles():
    """The graph has the edges the docstring promises, and a cycle is reported as one."""
    graph = import_graph()
    assert {"robe_torchrec.array_module", "robe_torchrec.torchscript"} <= graph[
        "robe_torchrec.embedding_bag"]
    assert "robe_torchrec" not in graph["robe_torchrec.embedding_bag"]  # its package: no edge
    assert "robe_torchrec.embedding_bag" in graph["robe_torchrec"]
    assert "robe_torchrec.pipelines" in graph  # pipelines/, as installed
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_function_level_import_is_an_edge(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from robe_torchrec.config import RobeConfig\n"
                      "    from . import layout\n")
    modules = {"robe_torchrec.config", "robe_torchrec.layout", "robe_torchrec.m"}
    assert imports_of("robe_torchrec.m", source, modules) == {"robe_torchrec.config",
                                                              "robe_torchrec.layout"}
