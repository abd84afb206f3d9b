"""Load a ``torch.export`` program (``.pt2``) you did not write, without running code from it.

``torch.export.load`` trusts its archive: it unpickles entries in full when a weights-only
load fails (the sample inputs, a legacy layout it falls back to), unpickles opaque and
custom objects, compiles and loads AOTInductor entries, evaluates shape expressions as
Python, and resolves any ``torch.*`` name a graph node calls. :func:`load_program` reads the
archive's bytes first and admits exactly the layout ``torch.export.save`` writes for a
program of tensors:

* one root folder, no entry named twice (zip readers disagree on which copy they take),
  and ``archive_version`` present (without it torch falls back to its legacy layout);
* below the root only the archive's format files, ``models/<name>.json``, the weights' and
  constants' configs, their raw tensor files ``weight_<n>`` / ``tensor_<n>``, and
  ``data/sample_inputs/<name>.pt``; model names are plain identifiers;
* every tensor the configs list is stored raw (``use_pickle`` false) in a file of the
  archive, the sample inputs load with ``torch.load(weights_only=True)``, and every shape
  expression is arithmetic on symbols.

Then torch loads those same bytes with full unpickling refused (``torch.load`` reads weights
only and ``pickle.load`` / ``pickle.loads`` raise, while it runs), and the graph may call
operators only. Anything else raises :class:`UnsafeProgramError` naming the file and the
entry, before any of it is unpickled or run.

Example::

    >>> program = load_program("outputs/serving_demo/dlrm.pt2")
    >>> program.module()(dense, kjt)
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import operator
import os
import pickle
import re
import threading
import zipfile
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.export import ExportedProgram

from robe_torchrec.weights_only import refusal


class UnsafeProgramError(ValueError):
    """A ``.pt2`` archive holds something that loading it could run as code (a pickle that
    needs full unpickling, a custom or opaque object, compiled code, an entry outside the
    layout ``torch.export.save`` writes, a shape expression that is not arithmetic, a call of
    something other than an operator); nothing of it was unpickled or run."""


#: the entries below an archive's root folder that ``torch.export.save`` writes for a
#: program of tensors
_ENTRY = re.compile(
    r"(?:archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/[A-Za-z0-9_]+\.json"
    r"|data/(?:weights|constants)/[A-Za-z0-9_]+_(?:weights|constants)_config\.json"
    r"|data/weights/weight_\d+|data/constants/tensor_\d+"
    r"|data/sample_inputs/[A-Za-z0-9_]+\.pt)")
#: what a weights or constants config may name as a tensor's file
_RAW_FILE = {"weights": re.compile(r"weight_\d+"), "constants": re.compile(r"tensor_\d+")}

#: names a program's shape expressions may use besides symbols (``s0``, ``u3``): the sympy
#: functions torch's serializer writes. Anything else could be a Python builtin, because
#: torch parses these strings with ``sympy.sympify``, which evaluates them.
_SYMPY_NAMES = frozenset((
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt",
    "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv",
    "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "Max", "Min", "Abs", "Eq", "Ne",
    "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "True", "False", "oo", "zoo", "nan",
    "Integer", "Rational", "Float", "floor", "ceiling", "sqrt", "Piecewise", "OpaqueUnaryFn",
    "BitwiseFn", "Mul", "Add", "Pow", "Symbol"))
_SYMBOL = re.compile(r"^[a-z]+\d+$")
# a name, a keyword argument (``positive=True``), a quoted symbol name (``Symbol('s0')``, as
# sympy's srepr writes them), a number, an operator
_TOKENS = re.compile(r"\s*(?:([a-z]+=)(?!=)|([A-Za-z][A-Za-z0-9]*)|'[A-Za-z0-9_]+'|"
                     r"\d+(?:\.\d+)?(?:e[+-]?\d+)?|\*\*|//|[-+*/%(),<>=!&|~^])")


def _check_expression(text: str) -> Optional[str]:
    """Why ``text`` is not a plain shape expression, or None."""
    pos = 0
    while pos < len(text.rstrip()):
        m = _TOKENS.match(text, pos)
        if not m or m.end() == pos:
            return f"unexpected {text[pos:pos + 10]!r}"
        name = m.group(2)
        if name and name not in _SYMPY_NAMES and not _SYMBOL.match(name):
            return f"the name {name!r}"
        pos = m.end()
    return None


def _walk_json(obj: Any, found: List[str]) -> None:
    """Every ``expr_str`` string in a serialized program."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "expr_str" and isinstance(v, str):
                found.append(v)
            else:
                _walk_json(v, found)
    elif isinstance(obj, list):
        for v in obj:
            _walk_json(v, found)


class _Archive:
    """A ``.pt2``'s entries below its root folder, checked against the layout (module
    docstring) as they are listed; ``refuse`` builds the error naming the file."""

    def __init__(self, path: Any, data: bytes) -> None:
        self.path = path
        try:
            self.zip = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile as e:
            raise ValueError(f"{path}: not a torch.export archive (.pt2): {e}") from None
        names = self.zip.namelist()
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise self.refuse(twice[0], "is stored twice (zip readers differ on which copy "
                                        "they read)")
        roots = {n.split("/", 1)[0] for n in names}
        if len(roots) != 1 or any("/" not in n for n in names):
            raise self.refuse(sorted(roots)[0] if roots else "the archive",
                              "is not the one root folder torch.export.save writes")
        self.root = roots.pop()
        self.entries: Dict[str, str] = {}  # below the root -> full name
        for name in names:
            rest = name.split("/", 1)[1]
            if not _ENTRY.fullmatch(rest):
                raise self.refuse(name, "is not an entry torch.export.save writes for a "
                                        "program of tensors (pickled, compiled or legacy "
                                        "entries run code when loaded)")
            self.entries[rest] = name
        if "archive_version" not in self.entries:
            raise self.refuse(f"{self.root}/archive_version", "is missing (torch then reads "
                                                             "its legacy layout, which "
                                                             "unpickles in full)")

    def refuse(self, entry: str, why: str) -> UnsafeProgramError:
        return UnsafeProgramError(f"{self.path}: refused, nothing loaded: {entry} {why}. Load "
                                  f"only programs you trust with torch.export.load")

    def read(self, rest: str) -> bytes:
        return self.zip.read(self.entries[rest])

    def names(self, pattern: str) -> List[str]:
        """The entries below the root that fully match ``pattern``."""
        return [rest for rest in self.entries if re.fullmatch(pattern, rest)]


def _check_tensor_configs(archive: _Archive) -> None:
    """Every tensor a weights or constants config lists is a raw file of the archive."""
    for kind, raw in _RAW_FILE.items():
        for rest in archive.names(rf"data/{kind}/[A-Za-z0-9_]+_{kind}_config\.json"):
            name = archive.entries[rest]
            try:
                config = json.loads(archive.read(rest)).get("config", {})
            except (ValueError, AttributeError) as e:
                raise ValueError(f"{archive.path}: {name} is not a tensor config ({e})") from None
            for key, entry in (config.items() if isinstance(config, dict) else ()):
                path_name = entry.get("path_name") if isinstance(entry, dict) else None
                if not isinstance(entry, dict) or entry.get("use_pickle") is not False \
                        or not isinstance(path_name, str) or not raw.fullmatch(path_name) \
                        or f"data/{kind}/{path_name}" not in archive.entries:
                    raise archive.refuse(name, f"lists {key!r} as something other than a "
                                               f"raw tensor file of the archive (a pickled "
                                               f"or custom object runs code when loaded)")


def _check_sample_inputs(archive: _Archive) -> None:
    for rest in archive.names(r"data/sample_inputs/[A-Za-z0-9_]+\.pt"):
        try:
            torch.load(io.BytesIO(archive.read(rest)), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any refusal of the weights-only unpickler
            raise archive.refuse(archive.entries[rest],
                                 f"does not load with weights_only=True (it needs a full "
                                 f"unpickle, which runs code: {refusal(e)})") from None


def _check_expressions(archive: _Archive) -> None:
    for rest in archive.names(r"models/[A-Za-z0-9_]+\.json"):
        name = archive.entries[rest]
        exprs: List[str] = []
        try:
            _walk_json(json.loads(archive.read(rest)), exprs)
        except ValueError as e:
            raise ValueError(f"{archive.path}: {name} is not a serialized program ({e})") from None
        for expr in exprs:
            bad = _check_expression(expr)
            if bad is not None:
                raise archive.refuse(name, f"holds the shape expression {expr[:80]!r}, which "
                                           f"is not arithmetic on symbols ({bad}); torch "
                                           f"evaluates these as Python")


#: one guarded load at a time: the guard swaps process-wide functions
_GUARD = threading.Lock()


@contextlib.contextmanager
def _full_unpickling_refused(path: Any) -> Iterator[None]:
    """While it lasts, ``torch.load`` reads weights only and ``pickle.load`` /
    ``pickle.loads`` raise: a path of ``torch.export.load`` the archive checks did not
    foresee fails instead of unpickling in full. Process-wide, for the load's duration."""
    real_load, real_pickle_load, real_pickle_loads = torch.load, pickle.load, pickle.loads

    def weights_only(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return real_load(*args, **kwargs)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise UnsafeProgramError(f"{path}: refused: loading it asked for a full unpickle, "
                                 f"which runs code. Load only programs you trust with "
                                 f"torch.export.load")

    with _GUARD:
        torch.load, pickle.load, pickle.loads = weights_only, refused, refused
        try:
            yield
        finally:
            torch.load, pickle.load, pickle.loads = (real_load, real_pickle_load,
                                                     real_pickle_loads)


def load_program(path: "str | os.PathLike") -> ExportedProgram:
    """``torch.export.load`` of a ``.pt2`` file you did not write, without running code
    from it (see the module docstring). Raises :class:`UnsafeProgramError` naming the file
    and the entry otherwise.

    Importing this module imported ``robe_torchrec``, which registered its ops and admitted
    the KJT class to weights-only loading (``export.allow_kjt_in_saved_programs``)."""
    with open(os.fspath(path), "rb") as f:
        data = f.read()  # checked and loaded from the same bytes
    archive = _Archive(path, data)
    _check_tensor_configs(archive)
    _check_sample_inputs(archive)
    _check_expressions(archive)
    with _full_unpickling_refused(path):
        program = torch.export.load(io.BytesIO(data))
    _check_targets(program, path)
    return program


def _check_targets(program: ExportedProgram, path: Any) -> None:
    """Refuse a program whose graph calls anything but operators, ``operator`` / ``math``
    functions and torch's symbolic-size helpers: the deserializer resolves any ``torch.*``
    name, ``torch.os.system`` included, and calling the program would run it."""
    plain = {getattr(operator, n) for n in dir(operator) if not n.startswith("_")}
    plain |= {getattr(math, n) for n in dir(math) if callable(getattr(math, n))}
    plain |= {getattr(torch, n) for n in ("sym_int", "sym_float", "sym_max", "sym_min",
                                          "sym_not", "sym_ite", "sym_sqrt", "sym_sum")
              if hasattr(torch, n)}
    ops = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else []:
            if node.op in ("call_method", "call_module"):
                raise UnsafeProgramError(f"{path}: refused: node {node.name} is a "
                                         f"{node.op}, which an exported program never has")
            if node.op == "call_function" and not isinstance(node.target, ops) \
                    and node.target not in plain:
                raise UnsafeProgramError(
                    f"{path}: refused: node {node.name} calls {node.target!r}, which is not "
                    f"an operator. Load only programs you trust with torch.export.load")


__all__ = ["UnsafeProgramError", "load_program"]
