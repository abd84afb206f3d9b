"""``torch.export`` of a model that takes ``(dense_features, KeyedJaggedTensor)``, such as
TorchRec's ``DLRM`` over ROBE-Z, for serving any batch size and any number of ids.

The program's inputs are the example's tensors, flattened: the dense features ``[B, D]``
and the KJT's fields (``values`` ``[N]``, ``lengths`` ``[F * B]`` for ``F`` features, and
``weights`` / ``offsets`` when the example has them). :func:`dynamic_shapes` makes ``B`` and
``N`` dynamic and ties ``lengths`` (and ``offsets``) to ``B``. Traced on a batch of two or
more, ``torch.export`` assumes the sizes are never 0 or 1 and the program would refuse a
batch of one (``Guard failed: sparse_features._lengths.size()[0] // 3 != 1``, stock
``EmbeddingBagCollection`` too); :func:`export_model` exports with PyTorch's (experimental)
``backed_size_oblivious`` setting, under which the same graph serves one sample and batches
without ids. See ``docs/drop_in.md`` (export) and ``docs/serving.md`` (``run.export``).

Example::

    >>> program = export_model(dlrm.eval(), dense, kjt)      # any example batch of >= 2
    >>> torch.export.save(program, "dlrm.pt2")
    >>> torch.export.load("dlrm.pt2").module()(dense[:1], one_sample_kjt)   # [1, 1]
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
import posixpath
import re
import zipfile
from typing import Any, List, Optional, Tuple

import torch
from torch.export import Dim, ExportedProgram
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def allow_kjt_in_saved_programs() -> bool:
    """Let ``torch.export.load`` read a program exported on a ``KeyedJaggedTensor`` with
    ``weights_only`` loading: the program keeps its example inputs, and without this
    ``torch.load(weights_only=True)`` refuses the KJT class, after which torch falls back to
    a full unpickle and prints a traceback from its own logging on every load. Called by
    :func:`robe_torchrec.install` only (so on ``import robe_torchrec``, which a serving
    process needs for the ops anyway); it allows the KJT class, a container of tensors, and
    nothing else. Idempotent; True once the class is allowed."""
    if KeyedJaggedTensor not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([KeyedJaggedTensor])
    return True


def kjt_dynamic_shapes(kjt: KeyedJaggedTensor, batch: Any) -> List[Optional[dict]]:
    """The ``dynamic_shapes`` entry of ``kjt`` (one per ``KeyedJaggedTensor._fields``, as
    its pytree flattens): ids dynamic, lengths ``len(keys) * batch``, the rest as given.

    Raises ``ValueError`` for a variable-batch KJT (its batch is not one size)."""
    if kjt.variable_stride_per_key():
        raise ValueError("export: a KeyedJaggedTensor with a variable batch per feature has no "
                         "single batch size to make dynamic; export with one stride for "
                         "every feature (KeyedJaggedTensor(keys, values, lengths))")
    features = len(kjt.keys())
    ids = Dim.DYNAMIC
    sizes = {"_values": ids, "_weights": ids, "_lengths": features * batch,
             "_offsets": features * batch + 1}
    spec: List[Optional[dict]] = []
    for field in KeyedJaggedTensor._fields:
        value = getattr(kjt, field, None)
        spec.append({0: sizes[field]} if isinstance(value, torch.Tensor) and field in sizes
                    else None)
    return spec


def dynamic_shapes(dense: torch.Tensor, kjt: KeyedJaggedTensor) -> Tuple[dict, list]:
    """``dynamic_shapes`` for ``torch.export.export(model, (dense, kjt), ...)``: the batch
    (``dense``'s first dimension, ``kjt``'s stride) and the number of ids are dynamic."""
    if dense.dim() != 2 or dense.size(0) != kjt.stride():
        raise ValueError(f"export: dense features {tuple(dense.shape)} and a "
                         f"KeyedJaggedTensor of batch {kjt.stride()} do not make one batch; "
                         "give [batch, num_dense] dense features for the KJT's batch")
    batch = Dim("batch")
    return {0: batch}, kjt_dynamic_shapes(kjt, batch)


def export_model(model: torch.nn.Module, dense: torch.Tensor, kjt: KeyedJaggedTensor,
                 strict: bool = False) -> ExportedProgram:
    """``torch.export`` ``model(dense, kjt)`` for any batch size (one included), any
    number of ids (none included) and int32 or int64 ids, lengths and offsets (each either,
    whatever the example's); outputs equal the eager model's. The example batch must have
    two samples or more (``torch.export`` specialises a size of 1)."""
    if kjt.stride() < 2:
        raise ValueError(f"export: the example batch has {kjt.stride()} sample(s); give two "
                         "or more (torch.export would fix the program's batch to it)")
    # the program's first step copies the ids, lengths and offsets to int64, whatever their
    # dtype: it then serves int32 and int64 (each field either) like the eager model, not
    # only the example's dtypes
    hook = model.register_forward_pre_hook(_int64_ids_hook, prepend=True)
    try:
        # general-case semantics for sizes 0 and 1: the program checks no batch != 1
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return torch.export.export(model, (dense, kjt),
                                       dynamic_shapes=dynamic_shapes(dense, kjt), strict=strict)
    finally:
        hook.remove()


def _as_int64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # ``_to_copy``, not ``.to``: ``.to`` of a tensor already int64 returns it, which export
    # guards with an assertion of the example's dtype (``Tensor dtype mismatch! Expected:
    # Int, Got: long int`` for a client whose dtype differs); a copy is dtype-agnostic
    return None if t is None else torch.ops.aten._to_copy.default(t, dtype=torch.int64)


def _int64_ids_hook(module: torch.nn.Module, args: Tuple) -> Optional[Tuple]:
    """Forward pre-hook of :func:`export_model`: the KJT argument with int64 ids, lengths
    and offsets (weights and the dense features as given)."""
    if len(args) != 2 or not isinstance(args[1], KeyedJaggedTensor):
        return None
    dense, kjt = args
    return dense, KeyedJaggedTensor(keys=kjt.keys(), values=_as_int64(kjt.values()),
                                    weights=kjt.weights_or_none(),
                                    lengths=_as_int64(kjt._lengths),
                                    offsets=_as_int64(kjt._offsets))


class UnsafeProgramError(ValueError):
    """A ``.pt2`` archive holds something that loading it could run as code (a pickle that
    needs full unpickling, a custom object, a shape expression that is not arithmetic, a
    call of something other than an operator); nothing of it was unpickled or run."""


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


def _pickled_entries(archive, names: List[str]) -> List[str]:
    """The entries of a ``.pt2`` that ``torch.export.load`` hands to ``torch.load``."""
    out = [n for n in names if "/data/sample_inputs/" in n]
    for n in names:
        parts = n.split("/")
        if len(parts) == 4 and parts[1] == "data" and parts[2] in ("weights", "constants") \
                and parts[3].endswith(".pt"):
            out.append(n)  # the legacy layout: one pickle of every weight or constant
        if n.endswith("_weights_config.json") or n.endswith("_constants_config.json"):
            config = json.loads(archive.read(n)).get("config", {})
            for entry in config.values():
                if isinstance(entry, dict) and entry.get("use_pickle"):
                    out.append(posixpath.join(posixpath.dirname(n), entry.get("path_name", "")))
    return out


def load_program(path: "str | os.PathLike") -> ExportedProgram:
    """``torch.export.load`` of a ``.pt2`` file you did not write, without running code
    from it: every pickle in the archive must load with ``torch.load(weights_only=True)``
    (torch would fall back to a full unpickle, or use one outright), its shape expressions
    must be arithmetic on symbols (torch evaluates them), and it may call operators only.
    Raises :class:`UnsafeProgramError` naming the file and the entry otherwise.

    Importing this module imported ``robe_torchrec``, which registered its ops and admitted
    the KJT class to weights-only loading (:func:`allow_kjt_in_saved_programs`)."""
    with open(os.fspath(path), "rb") as f:
        data = f.read()  # checked and loaded from the same bytes
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path}: not a torch.export archive (.pt2): {e}") from None
    names = archive.namelist()

    def refuse(entry: str, why: str) -> UnsafeProgramError:
        return UnsafeProgramError(f"{path}: refused, nothing loaded: {entry} {why}. Load only "
                                  f"programs you trust with torch.export.load")

    for name in names:
        if "/data/constants/custom_obj" in name:
            raise refuse(name, "is a custom (TorchBind) object, which loads as code")
    for name in _pickled_entries(archive, names):
        try:
            torch.load(io.BytesIO(archive.read(name)), weights_only=True)
        except KeyError:
            raise refuse(name, "is listed but missing") from None
        except Exception as e:  # noqa: BLE001 - any refusal of the weights-only unpickler
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            why = next((ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln),
                       lines[0] if lines else e)
            raise refuse(name, f"does not load with weights_only=True (it needs a full "
                               f"unpickle, which runs code: {why})") from None
    for name in names:
        if "/models/" in name and name.endswith(".json"):
            exprs: List[str] = []
            try:
                _walk_json(json.loads(archive.read(name)), exprs)
            except ValueError as e:
                raise ValueError(f"{path}: {name} is not a serialized program ({e})") from None
            for expr in exprs:
                bad = _check_expression(expr)
                if bad is not None:
                    raise refuse(name, f"holds the shape expression {expr[:80]!r}, which is "
                                       f"not arithmetic on symbols ({bad}); torch evaluates "
                                       f"these as Python")
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
