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

from typing import Any, List, Optional, Tuple

import torch
from torch.export import Dim, ExportedProgram
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# the loader of programs received from elsewhere, importable from here too
from robe_torchrec.safe_program import UnsafeProgramError, load_program


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


__all__ = ["UnsafeProgramError", "allow_kjt_in_saved_programs", "dynamic_shapes",
           "export_model", "kjt_dynamic_shapes", "load_program"]
