"""Load a ``torch.export`` program (``.pt2``) you did not write, without running code from it.

``torch.export.load`` trusts its archive: it unpickles entries in full when a weights-only
load fails (the sample inputs, a legacy layout it falls back to), unpickles opaque and
custom objects, compiles and loads AOTInductor entries, evaluates shape expressions as
Python, pastes the graph's names into the source of the ``forward`` it executes, and
resolves any ``torch.*`` name a graph node calls; ``program.module()`` executes the
program's guards. :func:`load_program` reads the archive's bytes first and admits exactly
the layout ``torch.export.save`` writes for a program of tensors:

* one root folder, no entry named twice (zip readers disagree on which copy they take),
  and ``archive_version`` present (without it torch falls back to its legacy layout);
* below the root only the archive's format files, ``models/<name>.json``, the weights' and
  constants' configs, their raw tensor files ``weight_<n>`` / ``tensor_<n>``, and
  ``data/sample_inputs/<name>.pt``; model names are plain identifiers;
* every tensor the configs list is stored raw (``use_pickle`` false) in a file of the
  archive, and the sample inputs load with ``torch.load(weights_only=True)``;
* in the programs' JSON: every shape expression is arithmetic on symbols, every guard a
  comparison of input sizes, every name an identifier and every module path dotted
  identifiers, every graph input a tensor, None or a symbolic size, and no line break
  outside a stack trace.

Then torch loads the checked entries, written again as a new archive (two zip readers can
see two archives in one file), with full unpickling refused (``torch.load`` reads weights
only and ``pickle.load`` / ``pickle.loads`` raise, while it runs). The graph may call, or
hand a higher-order operator, operators and control flow only, and the example inputs and
call specs may hold only identifier dict keys (``program.module()`` pastes their paths
into the guards it executes). Anything else raises :class:`UnsafeProgramError` naming the file and the
entry, before any of it is unpickled or run.

Example::

    >>> program = load_program("outputs/serving_demo/dlrm.pt2")
    >>> program.module()(dense, kjt)
"""

from __future__ import annotations

import ast
import collections
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
    "BitwiseFn", "Mul", "Add", "Pow", "Symbol", "GreaterThan", "LessThan",
    "StrictGreaterThan", "StrictLessThan", "Equality", "Unequality"))
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


#: fields of a serialized program whose strings torch pastes into Python source it runs
#: (FX's generated ``forward``): each must be an identifier
_NAME_FIELDS = frozenset(("name", "as_name"))
#: fields whose dict keys are such names
_NAMED_KEYS = frozenset(("tensor_values", "sym_int_values", "sym_bool_values",
                         "sym_float_values", "custom_obj_values"))
#: fields holding a module path (dot-separated identifiers; the root is "")
_PATH_FIELDS = frozenset(("parameter_name", "buffer_name", "tensor_constant_name",
                          "custom_obj_name", "fqn"))
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)?")


#: what a graph's input may be: torch pastes a string input's value into code it executes
_GRAPH_INPUTS = frozenset(("as_tensor", "as_none", "as_sym_int", "as_sym_bool", "as_sym_float"))


def _check_program_json(obj: Any, key: str = "") -> Optional[str]:
    """Why the serialized program ``obj`` (a ``models/<name>.json``) could make torch run
    code, or None: a shape expression that is not arithmetic (torch evaluates them with
    ``sympy.sympify``), a guard that is not a plain comparison (``program.module()``
    executes them), a name or path that is not an identifier (FX pastes them into the
    source of the ``forward`` it executes), a line break outside a stack trace (which would
    end the comment FX writes it into)."""
    if isinstance(obj, dict):
        if "nodes" in obj and isinstance(obj.get("inputs"), list):  # a graph
            for given in obj["inputs"]:
                kinds = set(given) if isinstance(given, dict) else {type(given).__name__}
                if not kinds or not kinds <= _GRAPH_INPUTS:
                    return f"a graph input given as {sorted(kinds)}, not a tensor, None or " \
                           f"a symbolic size"
        if key in _NAMED_KEYS:
            bad = [k for k in obj if not _IDENTIFIER.fullmatch(k)]
            if bad:
                return f"the name {bad[0][:80]!r}"
        if key == "range_constraints":  # keyed by shape expressions
            bad = [k for k in obj if _check_expression(k)]
            if bad:
                return f"the shape expression {bad[0][:80]!r}, which is not arithmetic " \
                       f"on symbols; torch evaluates these as Python"
        for k, v in obj.items():
            found = _check_program_json(v, k)
            if found:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _check_program_json(v, key)
            if found:
                return found
    elif isinstance(obj, str):
        if "\r" in obj or ("\n" in obj and key != "stack_trace"):
            return f"a line break in {key!r}: {obj[:80]!r}"
        if key == "expr_str":
            bad = _check_expression(obj)
            return bad and f"the shape expression {obj[:80]!r}, which is not arithmetic on " \
                           f"symbols ({bad}); torch evaluates these as Python"
        if key == "guards_code":
            bad = _check_guard(obj)
            return bad and f"the guard {obj[:80]!r}, which is not a comparison of input " \
                           f"sizes ({bad}); program.module() executes these as Python"
        if key in _NAME_FIELDS and not _IDENTIFIER.fullmatch(obj):
            return f"the name {obj[:80]!r}"
        if key in _PATH_FIELDS and not _PATH.fullmatch(obj):
            return f"the module path {obj[:80]!r}"
        if key == "forward_arg_names" and not _IDENTIFIER.fullmatch(obj):
            return f"the argument name {obj[:80]!r}"
    return None


#: what a guard may name: the inputs (``L``), and what torch's guard functions see
_GUARD_NAMES = frozenset(("L", "math", "inf", "IsNonOverlappingAndDenseIndicator",
                          "cast_symbool_to_symint_guardless"))
#: the methods a guard may call on an input
_GUARD_METHODS = frozenset(("size", "stride", "dim", "numel", "storage_offset"))
_GUARD_NODES = (ast.Expression, ast.Compare, ast.BinOp, ast.BoolOp, ast.UnaryOp, ast.Load,
                ast.Subscript, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)


def _check_guard(text: str) -> Optional[str]:
    """Why ``text`` is not a guard torch writes (``L['x'].size()[0] == 3 * L['y'].size()[0]``
    and the like), or None. Torch pastes each guard into a function's source and into a
    string literal of it, then executes that source."""
    if any(c in text for c in "\n\r#;\\\""):
        return "a line break, comment, semicolon, backslash or double quote"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        return f"not an expression ({e.msg})"
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if node.id not in _GUARD_NAMES:
                return f"the name {node.id!r}"
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float, bool)) and not (
                    isinstance(node.value, str) and _IDENTIFIER.fullmatch(node.value)):
                return f"the constant {node.value!r}"
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("__"):
                return f"the attribute {node.attr!r}"
        elif isinstance(node, ast.Call):
            func = node.func
            method = isinstance(func, ast.Attribute) and (
                func.attr in _GUARD_METHODS
                or isinstance(func.value, ast.Name) and func.value.id == "math")
            helper = isinstance(func, ast.Name) and func.id in _GUARD_NAMES - {"L", "math"}
            if node.keywords or not (method or helper):
                return f"the call {ast.unparse(node)[:40]!r}"
        elif not isinstance(node, _GUARD_NODES):
            return f"a {type(node).__name__}"
    return None


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

    def rebuilt(self) -> bytes:
        """The checked entries as a new archive, for torch: its zip reader and Python's can
        see different entries in one file (data in front of the archive, a second central
        directory), so torch gets only what was checked."""
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rebuilt:
            for name in self.entries.values():
                rebuilt.writestr(name, self.zip.read(name))
        return out.getvalue()

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


def _check_programs(archive: _Archive) -> None:
    for rest in archive.names(r"models/[A-Za-z0-9_]+\.json"):
        name = archive.entries[rest]
        try:
            program = json.loads(archive.read(rest))
        except ValueError as e:
            raise ValueError(f"{archive.path}: {name} is not a serialized program ({e})") from None
        bad = _check_program_json(program)
        if bad is not None:
            raise archive.refuse(name, f"holds {bad}")


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
        archive = _Archive(path, f.read())
    _check_tensor_configs(archive)
    _check_sample_inputs(archive)
    _check_programs(archive)
    with _full_unpickling_refused(path):
        program = torch.export.load(io.BytesIO(archive.rebuilt()))
    _check_targets(program, path)
    _check_inputs(program, path)
    held = [*program.state_dict.values(), *program.constants.values()]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in held):
        raise UnsafeProgramError(f"{path}: refused: it holds tensors on the meta device; with "
                                 f"tensors holding data an operator then returns memory as it "
                                 f"was left. Load only programs you trust with "
                                 f"torch.export.load")
    return program


#: the higher-order operators a program may call: control flow and the wrappers export
#: writes; others run what their arguments say (``print`` formats any string it is given,
#: ``call_torchbind`` and ``flat_apply`` call objects)
_HIGHER_ORDER = frozenset(("cond", "while_loop", "map_impl", "scan", "associative_scan",
                           "wrap_with_set_grad_enabled", "wrap_with_autocast",
                           "auto_functionalized", "auto_functionalized_v2", "invoke_subgraph",
                           "with_effects"))
#: a path into the inputs that torch pastes into a guard's source (``L['x'][0].y``)
_INPUT_PATH = re.compile(r"(?:\[\d+\]|\['[A-Za-z_][A-Za-z0-9_]*'\]|\.[A-Za-z_][A-Za-z0-9_]*)*")


def _check_inputs(program: ExportedProgram, path: Any) -> None:
    """Refuse inputs whose structure torch would paste into code: ``program.module()``
    writes a guard for each input, naming it by its path (dict keys included) inside the
    source it executes, and binds keyword inputs by their keys the same way."""
    import torch.utils._pytree as pytree

    for keys, _ in pytree.tree_flatten_with_path(program.example_inputs)[0]:
        where = pytree.keystr(keys)
        if not _INPUT_PATH.fullmatch(where):
            raise UnsafeProgramError(f"{path}: refused: an example input sits at {where[:80]!r}, "
                                     f"a path torch would paste into code it executes")
    specs = [program.call_spec.in_spec, program.call_spec.out_spec]
    specs += [spec for entry in program.module_call_graph if entry.signature is not None
              for spec in (entry.signature.in_spec, entry.signature.out_spec)]
    pending = [spec for spec in specs if spec is not None]
    while pending:
        spec = pending.pop()
        # (children() from torch 2.10 on; children_specs before, deprecated since)
        pending.extend(spec.children() if callable(getattr(spec, "children", None))
                       else spec.children_specs)
        if spec.type is dict or spec.type is collections.OrderedDict:
            bad = [k for k in spec.context
                   if not (isinstance(k, int) or isinstance(k, str) and _IDENTIFIER.fullmatch(k))]
            if bad:
                raise UnsafeProgramError(f"{path}: refused: its inputs or outputs hold the key "
                                         f"{str(bad[0])[:80]!r}, which torch would paste into "
                                         f"code it executes")


#: the operators a program may call: what DLRM, DCN and sequence models over ROBE-Z (or
#: TorchRec's tables) export to, and common ATen ops that check their arguments' bounds.
#: Not every ATen op does: ``_reshape_alias`` makes a view past its storage (a program
#: returning it hands out the process's memory), ``empty`` returns memory as it was left
#: (which a full-table program calls: load that with torch.export.load, if you trust it)
_OPERATORS = frozenset(f"aten::{name}" for name in (
    "_assert_scalar", "_assert_tensor_metadata", "_to_copy", "abs", "add", "addmm", "amax",
    "amin", "arange", "argmax", "argmin", "baddbmm", "batch_norm", "bitwise_and",
    "bitwise_not", "bitwise_or", "bitwise_xor", "bmm", "bucketize", "cat", "ceil", "chunk",
    "clamp", "clamp_max", "clamp_min", "clone", "contiguous", "cumsum", "detach", "div",
    "dropout", "eq", "exp", "expand", "flatten", "flip",
    "floor", "full", "full_like", "gather", "ge", "gelu", "gt", "index", "index_select",
    "item", "layer_norm", "le", "linear", "log", "log1p", "log_softmax", "logical_and",
    "logical_not", "logical_or", "lt", "masked_fill", "matmul", "max", "maximum", "mean",
    "min", "minimum", "mm", "mul", "narrow", "ne", "neg", "new_ones", "new_zeros",
    "native_layer_norm", "ones", "ones_like", "permute", "pow", "prod", "relu",
    "remainder", "repeat", "reshape", "round", "rsqrt", "scalar_tensor",
    "select", "sigmoid", "sign", "silu", "slice", "softmax", "split", "split_with_sizes",
    "sqrt", "squeeze", "stack", "sub", "sum", "sym_constrain_range",
    "sym_constrain_range_for_size", "sym_numel", "sym_size", "sym_stride", "t", "tanh",
    "to", "transpose", "tril", "triu", "triu_indices", "unbind", "unflatten", "unsqueeze",
    "view", "where", "zeros", "zeros_like")) | {
    "robe::forward", "robe::unpooled_keys",  # memory-safe against any arguments (ops.md)
    "fbgemm::asynchronous_complete_cumsum"}  # a KJT's offsets from its lengths
#: the ``operator`` functions a graph may call: arithmetic and comparisons on sizes (not
#: ``attrgetter``, ``methodcaller`` and the like, which reach any object)
_OPERATOR_FUNCTIONS = frozenset((
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq",
    "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift",
    "rshift", "getitem", "truth", "index"))


def _allowed_call(target: Any, plain: set) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return str(target._schema.name) in _OPERATORS
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name in _OPERATORS
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name() in _HIGHER_ORDER
    try:
        return target in plain
    except TypeError:  # unhashable
        return False


def _check_targets(program: ExportedProgram, path: Any) -> None:
    """Refuse a program whose graph calls anything but operators, ``operator`` / ``math``
    functions and torch's symbolic-size helpers: the deserializer resolves any ``torch.*``
    name, ``torch.os.system`` included, and calling the program would run it."""
    plain = {getattr(operator, n) for n in _OPERATOR_FUNCTIONS}
    plain |= {getattr(math, n) for n in dir(math) if callable(getattr(math, n))}
    plain |= {getattr(torch, n) for n in ("sym_int", "sym_float", "sym_max", "sym_min",
                                          "sym_not", "sym_ite", "sym_sqrt", "sym_sum")
              if hasattr(torch, n)}
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else []:
            if node.op in ("call_method", "call_module"):
                raise UnsafeProgramError(f"{path}: refused: node {node.name} is a "
                                         f"{node.op}, which an exported program never has")
            if node.op != "call_function":
                continue
            # what it calls, and what it hands a higher-order operator to call
            meta = _meta_devices((node.args, node.kwargs))
            if meta:
                raise UnsafeProgramError(
                    f"{path}: refused: node {node.name} puts a tensor on the meta device; with "
                    f"other tensors holding data an operator then returns memory as it was "
                    f"left. Load only programs you trust with torch.export.load")
            for target in [node.target, *_callables((node.args, node.kwargs))]:
                if not _allowed_call(target, plain):
                    raise UnsafeProgramError(
                        f"{path}: refused: node {node.name} calls {target!r}, which is not one "
                        f"of the memory-safe operators this loader admits. Load only programs "
                        f"you trust with torch.export.load")


def _meta_devices(value: Any) -> bool:
    """Whether a node's arguments (nested lists, tuples and dicts) name the meta device."""
    if isinstance(value, (list, tuple)):
        return any(_meta_devices(v) for v in value)
    if isinstance(value, dict):
        return any(_meta_devices(v) for v in value.values())
    return isinstance(value, torch.device) and value.type == "meta"


def _callables(value: Any) -> List[Any]:
    """The callables in a node's arguments (nested lists, tuples and dicts), graph nodes
    and modules aside."""
    if isinstance(value, (list, tuple)):
        return [c for v in value for c in _callables(v)]
    if isinstance(value, dict):
        return [c for v in value.values() for c in _callables(v)]
    if callable(value) and not isinstance(value, (torch.fx.Node, torch.nn.Module)):
        return [value]
    return []


__all__ = ["UnsafeProgramError", "load_program"]
