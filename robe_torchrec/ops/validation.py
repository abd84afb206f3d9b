"""Vectorised input checks shared by the reference and Triton paths.

The C++ kernel performs the same checks inside its own loops (for free) and raises the
same messages; every message starts with ``robe:`` and names the feature index, so the
module can translate it to a feature name. Each check is a handful of whole-tensor ops;
no Python loop runs over ids.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import torch

from robe_torchrec.hashing import HashMode, reference_key_limit
from robe_torchrec.ops import meta as m
from robe_torchrec.ops.weak_ids import WeakIdDict

INDEX_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_static(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
) -> None:
    """Checks on dtypes and shapes only (no data read, no device sync)."""
    if weights.dim() != 1 or weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"robe: weights must be a 1-D float tensor, got {weights.dtype} "
                         f"of shape {tuple(weights.shape)}")
    for name, tensor in (("values", values), ("offsets", offsets),
                         ("per_sample_weights", per_sample_weights)):
        # a meta input next to real weights reaches the fake kernel, which would return
        # uninitialised memory on the weights' device
        if tensor is not None and tensor.device != weights.device:
            raise ValueError(f"robe: {name} is on {tensor.device} but weights are on "
                             f"{weights.device}; move the input to the weights' device")
    if values.dtype not in INDEX_DTYPES:
        raise ValueError(f"robe: values (ids) must be int32 or int64, got {values.dtype}")
    if offsets.dtype != values.dtype:
        raise ValueError(f"robe: offsets dtype {offsets.dtype} must equal values dtype {values.dtype}")
    if values.dim() != 1 or offsets.dim() != 1:
        raise ValueError("robe: values and offsets must be 1-D")
    if table_meta.dtype != torch.int64 or table_meta.dim() != 2 or table_meta.shape[0] != m.NUM_META_FIELDS:
        raise ValueError(f"robe: table_meta must be int64 [{m.NUM_META_FIELDS}, T]")
    checked_batch(offsets, table_meta.shape[1])
    if per_sample_weights is not None:
        if not per_sample_weights.dtype.is_floating_point:
            raise ValueError(f"robe: per_sample_weights must be floating point, got "
                             f"{per_sample_weights.dtype}")
        if per_sample_weights.shape != values.shape:
            raise ValueError(f"robe: per_sample_weights has {per_sample_weights.numel()} entries "
                             f"but values has {values.numel()}")
    if block_size < 1:
        raise ValueError(f"robe: block_size must be >= 1, got {block_size}")
    check_enum("hash_mode", hash_mode, HashMode)


def checked_batch(offsets: torch.Tensor, num_features: int) -> int:
    """``B`` of ``offsets`` (``T * B + 1`` entries for ``T = num_features``); raises when
    the count is not of that form. The Triton ops check a layout once, for every batch
    size, and run this (a few integer operations) at every call."""
    num_bags = offsets.numel() - 1
    if num_features == 0 or num_bags < 0 or num_bags % num_features != 0:
        raise ValueError(f"robe: offsets has {offsets.numel()} entries; expected T * B + 1 "
                         f"with T = {num_features} features")
    return num_bags // num_features


def check_output_size(batch: int, output_dim: int) -> None:
    """The ``[batch, output_dim]`` output's byte offsets must fit int64 (the kernels index
    it that way)."""
    if batch > 0 and output_dim > (2**63 - 1) // 8 // batch:
        raise ValueError(f"robe: the output of {batch} samples x output_dim {output_dim} "
                         "elements is too large to allocate")


def check_grad_rows(grad_output: torch.Tensor, batch: int) -> None:
    """``grad_output`` is ``[B, output_dim]`` for the batch of ``B`` samples."""
    if grad_output.dim() != 2 or grad_output.shape[0] != batch:
        raise ValueError(f"robe: grad_output must be [B={batch}, output_dim], got "
                         f"{tuple(grad_output.shape)}")


@functools.lru_cache(maxsize=None)
def _members(kind: type) -> FrozenSet[int]:
    return frozenset(int(member) for member in kind)


def check_enum(argument: str, value: int, kind: type) -> None:
    """Refuse an integer that is no member of the IntEnum ``kind``, naming ``argument``
    (an unknown value would otherwise fall through to a kernel's default branch)."""
    if int(value) not in _members(kind):
        names = [f"{int(member)} ({member.name.lower()})" for member in kind]
        choices = ", ".join(names[:-1]) + f" or {names[-1]}"
        raise ValueError(f"robe: {argument} must be {choices}, got {value}")


def check_backward_inputs(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    summarize: Optional[Summarize] = None,
) -> torch.Tensor:
    """The checks of the backward ops: :func:`check_inputs` with ``grad_output``'s width as
    ``output_dim`` and ids unbounded (the forward checked them against ``num_embeddings``;
    any id hashes inside its array, so memory safety does not need that check again).
    Returns ``table_meta`` on the CPU."""
    meta_cpu, id_check = check_backward_layout(grad_output, weights, values, offsets,
                                               per_sample_weights, table_meta, block_size,
                                               hash_mode, hash_params)
    check_data_summarized(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check,
                          summarize)
    return meta_cpu


def check_backward_layout(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> Tuple[torch.Tensor, "IdCheck"]:
    """The checks of :func:`check_backward_inputs` that read no data, as
    :func:`check_layout` for the forward: ``(table_meta on the CPU, what ids are checked
    against)``."""
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    check_grad_rows(grad_output, (offsets.numel() - 1) // table_meta.shape[1])
    if not grad_output.dtype.is_floating_point:
        raise ValueError(f"robe: grad_output must be floating point, got {grad_output.dtype}")
    return _layout_after_static(weights, offsets, table_meta, grad_output.shape[1], block_size,
                                hash_mode, hash_params, int(m.BoundsCheck.UNBOUNDED))


def check_inputs(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    output_dim: int,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    bounds_check: int,
    summarize: Optional[Summarize] = None,
) -> torch.Tensor:
    """All checks, including the data-dependent ones (offsets, id bounds, finite per-sample
    weights); returns ``table_meta`` on the CPU.

    ``table_meta`` is checked once per tensor and version (see :func:`checked_table_meta`).
    ``summarize`` (the Triton ops pass one kernel that does it) reduces the data-dependent
    checks to one answer, clean or not, in one pass and one copy to the host; only when it
    is not clean do the checks run one by one, to raise the first problem's message. Without
    it they always run one by one (on an accelerator, a synchronisation each)."""
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    return _check_after_static(weights, values, offsets, per_sample_weights, table_meta,
                               output_dim, block_size, hash_mode, hash_params, bounds_check,
                               summarize)


def _check_after_static(weights: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                        per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                        output_dim: int, block_size: int, hash_mode: int,
                        hash_params: List[int], bounds_check: int,
                        summarize: Optional["Summarize"]) -> torch.Tensor:
    # check_inputs once check_static has passed: check_backward_inputs checks grad_output in
    # between, and running check_static twice on one call would repeat its checks
    meta_cpu, id_check = _layout_after_static(weights, offsets, table_meta, output_dim,
                                              block_size, hash_mode, hash_params, bounds_check)
    check_data_summarized(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check,
                          summarize)
    return meta_cpu


def check_data_summarized(values: torch.Tensor, offsets: torch.Tensor,
                          per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                          meta_cpu: torch.Tensor, id_check: "IdCheck",
                          summarize: Optional["Summarize"]) -> None:
    """The data-dependent checks: ``summarize``'s one answer when it has one and it is
    clean (or will be reported later), else :func:`check_data` (raises the first
    problem)."""
    if summarize is not None and summarize(values, offsets, per_sample_weights, table_meta,
                                           meta_cpu, id_check):
        return
    check_data(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check)


def check_layout(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    output_dim: int,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    bounds_check: int,
) -> Tuple[torch.Tensor, "IdCheck"]:
    """The checks of :func:`check_inputs` that read no data (dtypes, shapes, ``table_meta``,
    the hash's range); returns ``table_meta`` on the CPU and what every id is to be checked
    against, for a kernel that checks the data as it reads them."""
    check_static(weights, values, offsets, per_sample_weights, table_meta, block_size, hash_mode)
    return _layout_after_static(weights, offsets, table_meta, output_dim, block_size,
                                hash_mode, hash_params, bounds_check)


def _layout_after_static(weights: torch.Tensor, offsets: torch.Tensor,
                         table_meta: torch.Tensor, output_dim: int, block_size: int,
                         hash_mode: int, hash_params: List[int], bounds_check: int
                         ) -> Tuple[torch.Tensor, "IdCheck"]:
    # check_layout once check_static has passed
    check_enum("bounds_check", bounds_check, m.BoundsCheck)
    if len(hash_params) != 3:
        raise ValueError(f"robe: hash_params must hold 3 integers, got {len(hash_params)}")
    meta_cpu = checked_table_meta(table_meta, output_dim, block_size, weights.numel())
    facts = meta_facts(meta_cpu, block_size, output_dim)
    check_output_size((offsets.numel() - 1) // table_meta.shape[1], output_dim)
    if hash_mode == HashMode.MIX and facts.max_span >= 2**32:
        raise ValueError("robe: the mix hash needs memory_size - block_size + 1 < 2**32")
    return meta_cpu, id_check_of(facts, hash_mode, hash_params, bounds_check)


def id_check_of(facts: "MetaFacts", hash_mode: int, hash_params: List[int],
                bounds_check: int) -> "IdCheck":
    """What every id of a layout (its :class:`MetaFacts`) is checked against."""
    key_limit = None
    if bounds_check != m.BoundsCheck.ERROR and hash_mode == HashMode.REFERENCE:
        key_limit = reference_key_limit(facts.max_blocks, hash_params)
    in_bounds = bounds_check == m.BoundsCheck.ERROR
    # whether ids inside [0, num_rows) already pass the key limit (a forward's bounds check
    # then vouches for a backward's key check)
    return IdCheck(in_bounds, key_limit,
                   in_bounds or (key_limit is not None and facts.max_key_end <= key_limit))


class IdCheck(NamedTuple):
    """What every id is checked against: its feature's ``[0, num_embeddings)`` (bounds
    ERROR), or, for the reference hash with unbounded ids, ``0 <= id`` and
    ``id + row_offset < key_limit``; neither (mix hash, unbounded): nothing."""
    in_bounds: bool
    key_limit: Optional[int]
    #: whether every id inside its feature's ``[0, num_rows)`` passes this check
    implied_by_bounds: bool = False


#: ``summarize(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check) -> clean``:
#: whether every data-dependent check passes (offsets start at 0, end at ``values.numel()``
#: and never decrease; per-sample weights are finite; every id passes ``id_check``), or will
#: be reported by a later call (the Triton ops' deferred checks)
Summarize = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                      torch.Tensor, IdCheck], bool]

#: table_meta tensor -> (its version, the arguments it was checked with, its CPU copy)
_CHECKED_META: WeakIdDict = WeakIdDict()


def checked_table_meta(table_meta: torch.Tensor, output_dim: int, block_size: int,
                       weights_numel: int) -> torch.Tensor:
    """:func:`check_table_meta`, remembered per tensor: a module passes the same
    ``table_meta`` on every call, and copying it to the host and checking it again would cost
    an accelerator a synchronisation and dozens of small host ops per call. An in-place
    change bumps the tensor's version and brings the check back; inference tensors (no
    version) are checked every time."""
    try:
        version = table_meta._version
    except RuntimeError:
        version = None
    arguments = (output_dim, block_size, weights_numel)
    if version is not None:
        hit = _CHECKED_META.get(table_meta)
        if hit is not None and hit[0] == version and hit[1] == arguments:
            return hit[2]
    if table_meta.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "robe: a table_meta first seen inside a CUDA graph capture, which cannot copy it "
            "to the host to check it: make one call with this very tensor outside the "
            "capture first (a warm-up, as CUDA graphs need anyway). Under torch.compile's "
            "CUDA graphs, pass it as a module buffer (Dynamo marks those static; the ROBE "
            "modules do) or torch._dynamo.mark_static_address it: other inputs are copied "
            "into new tensors for the recording")
    meta_cpu = check_table_meta(table_meta, output_dim, block_size, weights_numel)
    if version is not None:
        # a CPU table_meta is its own CPU copy: keep a clone, so that the entry does not
        # hold its own key alive
        kept = meta_cpu.clone() if meta_cpu.data_ptr() == table_meta.data_ptr() else meta_cpu
        _CHECKED_META[table_meta] = (version, arguments, kept)
        return kept  # never the caller's tensor: what is derived from it may be kept too
    return meta_cpu


class MetaFacts(NamedTuple):
    """What the ops derive on the host from a checked ``table_meta`` (CPU copy)."""
    max_dim: int
    #: the most ROBE blocks a feature's row spans, ``ceil(dim / block_size)``
    max_blocks: int
    #: the largest ``memory_size - block_size + 1`` (the hash's range of block starts)
    max_span: int
    #: whether the features' columns tile ``[0, output_dim)`` exactly (then a kernel writes
    #: every output element, and the output needs no zeroing)
    covers_output: bool
    #: the largest ``row_offset + num_rows``: every in-range id's key lies below it
    max_key_end: int
    #: the smallest dim (a kernel that skips the ids of a feature without columns reads
    #: every id only when it is at least 1)
    min_dim: int
    #: whether some feature pools by its mean (else the bag kernels divide by nothing)
    any_mean: bool


#: id(meta_cpu) -> (meta_cpu, (block_size, output_dim, its version), MetaFacts); the entry
#: holds meta_cpu (a small host tensor), so its id cannot be reused while it is here
_FACTS: Dict[int, Tuple[torch.Tensor, Tuple[int, int, int], "MetaFacts"]] = {}
_MAX_FACTS = 64


def meta_facts(meta_cpu: torch.Tensor, block_size: int, output_dim: int) -> MetaFacts:
    """:class:`MetaFacts` of ``meta_cpu``, computed once per tensor, version and arguments
    (a dozen small host ops a call otherwise, a real share of a GPU op's host time)."""
    try:
        key: Optional[Tuple[int, int, int]] = (block_size, output_dim, meta_cpu._version)
    except RuntimeError:  # an inference tensor: no version to key on
        key = None
    hit = _FACTS.get(id(meta_cpu))
    if key is not None and hit is not None and hit[0] is meta_cpu and hit[1] == key:
        return hit[2]
    dims, sizes = meta_cpu[m.DIM].tolist(), meta_cpu[m.W_SIZE].tolist()
    key_ends = (meta_cpu[m.ROW_OFFSET] + meta_cpu[m.NUM_ROWS]).tolist()
    end = 0
    for start, dim in sorted(zip(meta_cpu[m.OUT_OFFSET].tolist(), dims)):
        end = end + dim if start == end else -1
    facts = MetaFacts(max(dims, default=0), max((-(-d // block_size) for d in dims), default=0),
                      max((size - block_size + 1 for size in sizes), default=0),
                      end == output_dim, max(key_ends, default=0), min(dims, default=0),
                      int(m.Pooling.MEAN) in meta_cpu[m.POOLING].tolist())
    if key is not None:
        if len(_FACTS) >= _MAX_FACTS:
            _FACTS.clear()
        _FACTS[id(meta_cpu)] = (meta_cpu, key, facts)
    return facts


def check_data(values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                meta_cpu: torch.Tensor, id_check: IdCheck) -> None:
    """The data-dependent checks one by one, in order: raises the first problem's message."""
    num_features = table_meta.shape[1]
    batch = (offsets.numel() - 1) // num_features
    offs = offsets.to(torch.int64)
    if int(offs[0]) != 0:
        raise ValueError(f"robe: offsets[0] must be 0, got {int(offs[0])}")
    if int(offs[-1]) != values.numel():
        raise ValueError(f"robe: offsets[-1] = {int(offs[-1])} but values has {values.numel()} "
                         f"entries (lengths do not match values)")
    lengths = offs[1:] - offs[:-1]
    if lengths.numel() and bool((lengths < 0).any()):
        bag = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"robe: offsets decrease at bag {bag} (feature {bag // max(batch, 1)}, "
                         f"sample {bag % max(batch, 1)}): {int(offs[bag])} -> {int(offs[bag + 1])}")
    if per_sample_weights is not None and values.numel():
        bad = ~torch.isfinite(per_sample_weights)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0])
            raise ValueError(f"robe: per_sample_weights[{pos}] is {float(per_sample_weights[pos])}; "
                             "weights must be finite")
    if values.numel() == 0:
        return
    # Feature of every value: features own contiguous runs of values.
    feature_ends = offs[torch.arange(1, num_features + 1, device=offs.device) * batch]
    feature = torch.bucketize(torch.arange(values.numel(), device=values.device), feature_ends, right=True)
    check_ids(values, feature, table_meta, meta_cpu, id_check)


def check_ids(values: torch.Tensor, feature: torch.Tensor, table_meta: torch.Tensor,
              meta_cpu: torch.Tensor, id_check: IdCheck) -> None:
    """The id checks of :func:`check_data`, given every value's feature: raises the first
    id that fails ``id_check``, naming its position and feature."""
    vals = values.to(torch.int64)
    key_limit = id_check.key_limit
    if id_check.in_bounds:
        upper = table_meta[m.NUM_ROWS].to(values.device)[feature]
        _raise_first(vals, (vals < 0) | (vals >= upper), feature,
                     lambda t: f"is out of range [0, {int(meta_cpu[m.NUM_ROWS, t])}){RAW_IDS_HINT}")
    elif key_limit is not None:
        keys = vals + table_meta[m.ROW_OFFSET].to(values.device)[feature]
        _raise_first(vals, (vals < 0) | (keys >= key_limit), feature,
                     lambda t: f"cannot be hashed by the reference hash (keys must lie in "
                               f"[0, {key_limit}); use hash='mix' for arbitrary 64-bit ids)")


def check_table_meta(table_meta: torch.Tensor, output_dim: int, block_size: int,
                     weights_numel: int) -> torch.Tensor:
    """The metadata checks of the C++ ``parse_layout``, in its order and with its messages;
    returns ``table_meta`` on the CPU. Every field but ROW_OFFSET is checked non-negative
    first, so the bounds compare as ``a > limit - b``: no int64 sum can wrap and pass."""
    meta_cpu = table_meta.cpu()
    if output_dim < 0:
        raise ValueError(f"robe: output_dim must be >= 0, got {output_dim}")
    fields = torch.tensor([m.OUT_OFFSET, m.DIM, m.W_OFFSET, m.W_SIZE, m.NUM_ROWS])
    pooling = meta_cpu[m.POOLING]
    # one row per feature: its negative fields, then an unknown pooling (the C++ order)
    bad = torch.cat([meta_cpu[fields].T < 0, ((pooling != m.Pooling.SUM) &
                                              (pooling != m.Pooling.MEAN))[:, None]], dim=1)
    if bool(bad.any()):
        t, j = (int(v) for v in torch.nonzero(bad)[0])
        if j < len(fields):
            raise ValueError(f"robe: table_meta holds a negative entry (field {int(fields[j])}) "
                             f"for feature {t}")
        raise ValueError(f"robe: table_meta POOLING of feature {t} is {int(pooling[t])}; "
                         "expected 0 (sum) or 1 (mean)")
    if bool((meta_cpu[m.DIM] > output_dim - meta_cpu[m.OUT_OFFSET]).any()):
        raise ValueError(f"robe: output_dim {output_dim} is smaller than the features' dims")
    sizes = meta_cpu[m.W_SIZE]
    if bool((sizes < block_size).any()) or bool((sizes > weights_numel - meta_cpu[m.W_OFFSET]).any()):
        raise ValueError(f"robe: every ROBE array must hold at least block_size={block_size} "
                         f"floats and lie inside weights ({weights_numel} floats)")
    return meta_cpu


def check_optimizer_args(weights: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                         optimizer: int, hparams: List[float], step: int, block_size: int) -> None:
    """The fused backward's optimizer arguments: a known optimizer, 5 hparams, contiguous
    weights, and the state tensors that optimizer reads, of the right size and dtype. Call
    it after :func:`check_static`, which checks ``block_size`` (the row-wise state's size
    divides by it). Runs at every fused step, so it builds nothing it can look up."""
    kind = _OPTIMIZERS.get(optimizer)
    if kind is None:
        raise ValueError(f"robe: unknown fused optimizer {optimizer}; optimizer must be 0 (sgd), "
                         "1 (adagrad), 2 (adam) or 3 (rowwise_adagrad)")
    if len(hparams) != len(m.HPARAM_NAMES):
        raise ValueError(f"robe: hparams must hold {len(m.HPARAM_NAMES)} floats "
                         f"{m.HPARAM_NAMES}, got {len(hparams)}")
    if not weights.is_contiguous():
        raise ValueError("robe: the fused backward updates weights in place; they must be "
                         "contiguous")
    if kind == m.Optimizer.SGD:
        needed: Tuple[Tuple[str, torch.Tensor, tuple], ...] = ()
    elif kind == m.Optimizer.ROWWISE_ADAGRAD:
        needed = (("state1", state1, (m.rowwise_state_size(weights.numel(), block_size),)),)
    elif kind == m.Optimizer.ADAM:
        needed = (("state1", state1, weights.shape), ("state2", state2, weights.shape))
    else:
        needed = (("state1", state1, weights.shape),)
    acc = m.accumulation_dtype(weights.dtype)
    for name, state, shape in needed:
        if state.shape != shape or not state.is_contiguous() or state.dtype != acc \
                or state.device != weights.device:
            raise ValueError(f"robe: {name} must be a contiguous {acc} tensor of shape "
                             f"{tuple(shape)} on {weights.device} for {weights.dtype} weights "
                             f"{tuple(weights.shape)}, got {state.dtype} {tuple(state.shape)} "
                             f"on {state.device}")
    if kind == m.Optimizer.ADAM and step < 1:
        raise ValueError(f"robe: Adam's step counts from 1 (bias correction), got {step}")


def check_rate(lr: Optional[torch.Tensor], weights: torch.Tensor) -> None:
    """The fused backward's learning-rate tensor, where given: one float on the weights'
    device (the kernels read it there; hparams[0] is then not read)."""
    if lr is None:
        return
    if lr.numel() != 1 or not lr.is_floating_point() or lr.device != weights.device:
        raise ValueError(f"robe: lr must be one float on the weights' device "
                         f"({weights.device}), got {lr.dtype} of shape {tuple(lr.shape)} on "
                         f"{lr.device}")


def with_rate(hparams: List[float], lr: Optional[torch.Tensor],
              weights: torch.Tensor) -> List[float]:
    """``hparams`` with the rate read from ``lr`` where given: for the kernels that read the
    hyper-parameters on the host, which a CPU tensor's read does not make wait."""
    check_rate(lr, weights)
    if lr is None:
        return list(hparams)
    return [float(lr)] + list(hparams[1:])


#: the fused optimizers by their number
_OPTIMIZERS = {int(o): o for o in m.Optimizer}


#: the end of the out-of-range id message (the C++ kernel's ``kRawIdsHint`` says the same)
RAW_IDS_HINT = ("; ids must lie in [0, num_embeddings): to look up raw ids (any 64-bit "
                "value), hash them with RobeConfig(bounds_check=\"unbounded\", hash=\"mix\")")


def _raise_first(vals: torch.Tensor, bad: torch.Tensor, feature: torch.Tensor, describe) -> None:
    if bool(bad.any()):
        pos = int(torch.nonzero(bad)[0])
        t = int(feature[pos])
        raise ValueError(f"robe: id {int(vals[pos])} at position {pos} of feature {t} {describe(t)}")


def check_shapes_only(*tensors: Optional[torch.Tensor]) -> None:
    """A fake (shape-only) kernel is reached with tensors on the meta device or fake ones
    only; a tensor that holds data got here because another argument is on the meta device,
    and the kernel would return memory as it was left, checked by nothing: refuse it."""
    from torch._subclasses.fake_tensor import is_fake

    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if "meta" in devices and any(isinstance(t, torch.Tensor) and not t.is_meta
                                 and not is_fake(t) for t in tensors):
        raise ValueError(f"robe: the arguments mix the meta device with tensors holding data "
                         f"(devices {sorted(devices)}); put them all on one device")
