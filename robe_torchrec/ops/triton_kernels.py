"""Triton kernels of the ROBE-Z ops: the implementation for CUDA tensors.

Same signatures as :mod:`robe_torchrec.ops.reference` (and the registered ``torch.ops.robe``
ops). On CPU tensors the kernels run in Triton's interpreter (numpy, slow; how CI tests them)
when ``TRITON_INTERPRET=1`` was set before triton was imported; see :func:`_kernels_for`.

Layout of the work
------------------
One launch serves all ``T`` features. A program owns one bag ``(t, b)`` (``program_id(0)
= t * B + b``, the bag's position in ``offsets``) and, for forward/backward, one tile of its
columns (``program_id(1)``). A column tile is a ``[BLOCK_B, BLOCK_Z]`` grid of
``(ROBE block, offset in block)`` pairs, so the hash is computed once per block (not once per
column) and broadcast over the ``Z`` elements of the block::

    column j = blk * Z + s,   blk in tile * BLOCK_B + [0, BLOCK_B),  s in [0, BLOCK_Z)

(``BLOCK_Z`` is ``Z`` rounded up to a power of two; columns with ``s >= Z`` or ``j >= D_t``
are masked). The program walks its bag ``BLOCK_N`` ids at a time (dynamic loop bounds from
``offsets``); every step handles a ``[BLOCK_N, BLOCK_B, BLOCK_Z]`` tile of elements::

    idx = W_OFFSET + start(key, blk) + s          (start from the hash helpers below)

The hash helpers (:func:`_reference_start`, :func:`_mix_start`) re-implement
:mod:`robe_torchrec.hashing` bit-exactly: int64 arithmetic for the reference hash, uint64
wrapping multiplies and logical shifts for the mix hash.

Accumulation is in float32 (float64 for float64 weights), and so is the pooled output: float16
and bfloat16 weights are read as stored and give a float32 output; the fused update steps them
in float32 and writes them back rounded, with float32 optimizer state. Gradients are scattered with
``tl.atomic_add``: float32 atomics on the GPU make ``backward_dense`` (and the fused update)
non-deterministic in the last bits.
"""

import math
import os
import sys
from typing import List, NamedTuple, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from robe_torchrec.hashing import (
    FMIX_C1,
    FMIX_C2,
    GOLDEN,
    REFERENCE_PRIME,
    HashMode,
    to_signed64,
)
from robe_torchrec.ops import deferred_checks
from robe_torchrec.ops import meta as m
from robe_torchrec.ops.tuning import current as current_tuning
from robe_torchrec.ops.validation import (IdCheck, check_backward_inputs, check_data,
                                          check_layout, check_optimizer_args, meta_facts)

try:
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # the module must import without triton; calls raise instead
    _TRITON_IMPORT_ERROR = exc

    class _Missing:
        """Stand-in for ``triton`` / ``triton.language`` so the definitions below evaluate."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            return self

    triton = tl = _Missing()

#: test hook: fill buffers allocated with ``torch.empty`` with NaN before kernels write them
POISON_EMPTY = os.environ.get("ROBE_TRITON_POISON", "0") == "1"

_OPTIM_BLOCK = 1024
_SUMMARY_BLOCK = 1024

# --- constants visible inside @triton.jit code ------------------------------------------
_REFERENCE_PRIME = tl.constexpr(REFERENCE_PRIME)
_GOLDEN = tl.constexpr(GOLDEN)
_FMIX_C1 = tl.constexpr(FMIX_C1)
_FMIX_C2 = tl.constexpr(FMIX_C2)
_HASH_REFERENCE = tl.constexpr(int(HashMode.REFERENCE))
_MEAN = tl.constexpr(int(m.Pooling.MEAN))
_SGD = tl.constexpr(int(m.Optimizer.SGD))
_ADAGRAD = tl.constexpr(int(m.Optimizer.ADAGRAD))
_ADAM = tl.constexpr(int(m.Optimizer.ADAM))
_F_OUT_OFFSET = tl.constexpr(m.OUT_OFFSET)
_F_DIM = tl.constexpr(m.DIM)
_F_W_OFFSET = tl.constexpr(m.W_OFFSET)
_F_W_SIZE = tl.constexpr(m.W_SIZE)
_F_ROW_OFFSET = tl.constexpr(m.ROW_OFFSET)
_F_NUM_ROWS = tl.constexpr(m.NUM_ROWS)
_F_POOLING = tl.constexpr(m.POOLING)


# =========================================================================================
# Hash helpers (the formulas of robe_torchrec.hashing)
# =========================================================================================

@triton.jit
def _fmix64(x):
    """MurmurHash3 fmix64 of a uint64 tensor (wrapping multiplies, logical shifts)."""
    x ^= x >> 33
    x *= _FMIX_C1
    x ^= x >> 33
    x *= _FMIX_C2
    x ^= x >> 33
    return x


@triton.jit
def _reference_start(key, blk, span, a, b, c):
    """``((key * A + blk * B + C) mod P) mod span``, computed as
    ``((key * A) mod P + (blk * B + C) mod P) mod P``: the product's remainder once per key
    and the block term's once per block, not once per (key, block) pair, then one compare
    to fold the sum back below P. Every start is below P < 2**31, so the remainder by
    ``span`` is taken in 32 bits where ``span`` fits (a larger span leaves it as it is).

    Validated keys never overflow int64, so these are the reference's values exactly; a
    key that fails its check (reported later when checks are deferred) may wrap, and the
    unsigned remainders still land in ``[0, P)``, so that no start falls outside the
    array."""
    per_key = (key * a).to(tl.uint64, bitcast=True) % _REFERENCE_PRIME
    per_block = (blk * b + c).to(tl.uint64, bitcast=True) % _REFERENCE_PRIME
    h = per_key + per_block
    h = tl.where(h >= _REFERENCE_PRIME, h - _REFERENCE_PRIME, h)
    span32 = tl.minimum(span, _REFERENCE_PRIME).to(tl.uint32)
    folded = (h.to(tl.uint32) % span32).to(tl.int64)
    return tl.where(span > _REFERENCE_PRIME, h.to(tl.int64, bitcast=True), folded)


@triton.jit
def _mix_start(key, blk, span, salt):
    """``base = fmix64(key + salt)``, ``h = fmix64(base + (blk + 1) * GOLDEN)``,
    ``start = ((h >> 32) * span) >> 32``, all in uint64; returns int64."""
    base = _fmix64(key.to(tl.uint64, bitcast=True) + salt.to(tl.uint64, bitcast=True))
    h = _fmix64(base + (blk + 1).to(tl.uint64, bitcast=True) * _GOLDEN)
    start = ((h >> 32) * span.to(tl.uint64, bitcast=True)) >> 32
    return start.to(tl.int64, bitcast=True)


@triton.jit
def _i64(x):
    """``x`` as an int64 tensor, whether it arrived as a tensor or as a Python int: Triton
    turns an integer argument equal to 1 into the constant 1 (no ``.to``), and the
    interpreter keeps a Python int in [2**31, 2**32) as uint32 data typed int64. Adding a
    zero is free when compiled."""
    return x + tl.zeros([], dtype=tl.int64)


@triton.jit
def _block_start(key, blk, span, p0, p1, p2, HASH_MODE: tl.constexpr):
    """Start of block ``blk`` of hash key ``key`` (int64 tensors that broadcast together)
    under the hash parameters ``p0, p1, p2`` (scalar kernel arguments)."""
    p0, p1, p2 = _i64(p0), _i64(p1), _i64(p2)
    if HASH_MODE == _HASH_REFERENCE:
        start = _reference_start(key, blk, span, p0, p1, p2)
    else:
        start = _mix_start(key, blk, span, p0)
    return start


@triton.jit
def _div_rn(x, y):
    """IEEE (round-to-nearest) division, as torch divides; Triton's float32 ``/`` may not be."""
    if x.dtype == tl.float32:
        q = tl.div_rn(x, y)
    else:
        q = x / y
    return q


@triton.jit
def _sqrt_rn(x):
    """IEEE square root, as torch's; ``tl.sqrt`` on float32 is approximate."""
    if x.dtype == tl.float32:
        r = tl.sqrt_rn(x)
    else:
        r = tl.sqrt(x)
    return r


# =========================================================================================
# Traversal helpers shared by the kernels
# =========================================================================================

@triton.jit
def _feature_meta(meta_ptr, num_features, t):
    """Feature ``t``'s column of ``table_meta`` (int64 ``[7, T]``):
    ``(out_offset, dim, w_offset, w_size, row_offset, pooling)``."""
    col = meta_ptr + t
    n = _i64(num_features)
    return (tl.load(col + _F_OUT_OFFSET * n), tl.load(col + _F_DIM * n),
            tl.load(col + _F_W_OFFSET * n), tl.load(col + _F_W_SIZE * n),
            tl.load(col + _F_ROW_OFFSET * n), tl.load(col + _F_POOLING * n))


@triton.jit
def _bag_range(offsets_ptr, bag, num_values, mask):
    """Bag ``bag``'s id range ``[lo, hi)`` with ``lo >= 0`` and ``hi <= num_values`` (empty
    when ``hi <= lo``): with the input checks deferred, bad offsets reach the kernels, and
    must neither make them read outside ``values`` nor loop for ever (the check reports
    them later). Valid offsets pass unchanged."""
    lo = tl.load(offsets_ptr + bag, mask=mask, other=0).to(tl.int64)
    hi = tl.load(offsets_ptr + bag + 1, mask=mask, other=0).to(tl.int64)
    return tl.maximum(lo, 0), tl.minimum(hi, num_values)


@triton.jit
def _bag_setup(meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z: tl.constexpr,
               ACC: tl.constexpr):
    """What every kernel needs about bag ``bag`` (feature-major): its sample ``b``, its
    feature's output offset, dim, array offset, hash span and row offset, its id range
    ``[lo, hi)``, and what its sum is divided by (its size, at least 1, for MEAN; else 1)."""
    t = bag // batch
    b = bag % batch
    out_offset, dim, w_offset, w_size, row_offset, pooling = _feature_meta(meta_ptr,
                                                                           num_features, t)
    lo, hi = _bag_range(offsets_ptr, bag, num_values, bag >= 0)
    divisor = tl.where(pooling == _MEAN, tl.maximum(hi - lo, 1), 1).to(ACC)
    return b, out_offset, dim, w_offset, w_size - Z + 1, row_offset, lo, hi, divisor


@triton.jit
def _column_tile(tile, dim, Z: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr):
    """Blocks ``[BLOCK_B, 1]`` (int64), in-block offsets ``[1, BLOCK_Z]``, the columns
    ``[BLOCK_B, BLOCK_Z]`` they form and the mask of the valid ones, for column tile ``tile``."""
    blk = tile * BLOCK_B + tl.arange(0, BLOCK_B)[:, None].to(tl.int64)
    s = tl.arange(0, BLOCK_Z)[None, :]
    cols = blk * Z + s
    mask = (s < Z) & (cols < dim)
    return blk, s, cols, mask


@triton.jit
def _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
                     p0, p1, p2, HASH_MODE: tl.constexpr):
    """Flat indices ``[BLOCK_N, BLOCK_B, BLOCK_Z]`` into ``weights`` of the elements of the
    ids at positions ``i`` (``[BLOCK_N]``) for the blocks ``blk`` and offsets ``s``."""
    ids = tl.load(values_ptr + i, mask=id_mask, other=0).to(tl.int64)
    key = ids + row_offset  # wraps like the uint64 key of the mix hash
    start = _block_start(key[:, None, None], blk[None, :, :], span, p0, p1, p2, HASH_MODE)
    return w_offset + start + s[None, :, :]


@triton.jit
def _stored_indices(starts_ptr, i, id_mask, w_offset, blk, s, NUM_BLOCKS: tl.constexpr):
    """:func:`_element_indices` from the block starts ``_hash_starts_kernel`` stored
    (``[num_values, NUM_BLOCKS]``): a load instead of the hash."""
    mask = id_mask[:, None, None] & (blk[None, :, :] < NUM_BLOCKS)
    start = tl.load(starts_ptr + i[:, None, None].to(tl.int64) * NUM_BLOCKS + blk[None, :, :],
                    mask=mask, other=0).to(tl.int64)
    return w_offset + start + s[None, :, :]


@triton.jit
def _indices(values_ptr, starts_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
             p0, p1, p2, HASH_MODE: tl.constexpr, STARTS: tl.constexpr,
             NUM_BLOCKS: tl.constexpr):
    """The elements' flat indices, hashed here or (``STARTS``) read from the stored starts."""
    if STARTS:
        idx = _stored_indices(starts_ptr, i, id_mask, w_offset, blk, s, NUM_BLOCKS)
    else:
        idx = _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
                               p0, p1, p2, HASH_MODE)
    return idx


@triton.jit
def _weighted_rows(w_ptr, values_ptr, psw_ptr, i, id_mask, col_mask, row_offset, w_offset,
                   span, blk, s, p0, p1, p2, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr,
                   ACC: tl.constexpr, starts_ptr, STARTS: tl.constexpr,
                   NUM_BLOCKS: tl.constexpr):
    """The elements ``[N, BLOCK_B, BLOCK_Z]`` of the ids at positions ``i`` (``[N]``) in
    the column tile, times their per-sample weights; 0 where masked."""
    idx = _indices(values_ptr, starts_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
                   p0, p1, p2, HASH_MODE, STARTS, NUM_BLOCKS)
    mask = id_mask[:, None, None] & col_mask[None, :, :]
    rows = tl.load(w_ptr + idx, mask=mask, other=0.0).to(ACC)
    if HAS_PSW:
        psw = tl.load(psw_ptr + i, mask=id_mask, other=0.0).to(ACC)
        rows = rows * psw[:, None, None]
    return rows


@triton.jit
def _short_bags_setup(meta_ptr, offsets_ptr, batch, num_features, num_values, Z: tl.constexpr,
                      ACC: tl.constexpr, BLOCK_BAGS: tl.constexpr, BLOCK_B: tl.constexpr,
                      BLOCK_Z: tl.constexpr):
    """What the short-bags kernels need about their ``BLOCK_BAGS`` bags (``program_id(0)`` =
    feature * groups + group) and column tile (``program_id(1)``): the bags' samples
    ``[BLOCK_BAGS]``, their feature's output offset, array offset, hash span and row offset,
    their id ranges and divisors, the longest bag (0 when the tile holds no column of the
    feature), the column tile, and the mask of the bags' valid output elements."""
    groups = tl.cdiv(batch, BLOCK_BAGS)
    t = tl.program_id(0).to(tl.int64) // groups
    group = tl.program_id(0).to(tl.int64) % groups
    tile = tl.program_id(1).to(tl.int64)
    out_offset, dim, w_offset, w_size, row_offset, pooling = _feature_meta(meta_ptr,
                                                                           num_features, t)
    blk, s, cols, col_mask = _column_tile(tile, dim, Z, BLOCK_B, BLOCK_Z)
    b = group * BLOCK_BAGS + tl.arange(0, BLOCK_BAGS).to(tl.int64)
    bag_mask = b < batch
    lo, hi = _bag_range(offsets_ptr, t * batch + b, num_values, bag_mask)
    divisor = tl.where(pooling == _MEAN, tl.maximum(hi - lo, 1), 1).to(ACC)
    longest = tl.where(tile * BLOCK_B * Z >= dim, 0, tl.max(hi - lo, axis=0))
    mask = bag_mask[:, None, None] & col_mask[None, :, :]
    return (b, out_offset, w_offset, w_size - Z + 1, row_offset, lo, hi, divisor, longest,
            blk, s, cols, col_mask, mask)


@triton.jit
def _count_value_problems(bad_ids, bad_weights, values_ptr, psw_ptr, i, id_mask, num_rows,
                          row_offset, key_limit, HAS_PSW: tl.constexpr,
                          IN_BOUNDS: tl.constexpr, KEY_LIMIT: tl.constexpr):
    """``bad_ids`` and ``bad_weights`` (counts per lane) plus 1 at each position ``i`` whose
    id fails its check (IN_BOUNDS: outside ``[0, num_rows)``; KEY_LIMIT: negative, or
    ``id + row_offset >= key_limit``), respectively whose per-sample weight is not finite;
    masked positions add 0. The value checks of ``_input_summary_kernel``, for a kernel that
    reads the ids anyway."""
    if IN_BOUNDS or KEY_LIMIT:
        ids = tl.load(values_ptr + i, mask=id_mask, other=0).to(tl.int64)
        if IN_BOUNDS:
            bad = (ids < 0) | (ids >= num_rows)
        else:
            bad = (ids < 0) | (ids + row_offset >= key_limit)
        bad_ids += (bad & id_mask).to(tl.int64)
    if HAS_PSW:
        w = tl.load(psw_ptr + i, mask=id_mask, other=0.0).to(tl.float64)
        bad_weights += (((w != w) | (tl.abs(w) == float("inf"))) & id_mask).to(tl.int64)
    return bad_ids, bad_weights


@triton.jit
def _report_problems(problems_ptr, offsets_ptr, num_bags, num_values, counts_here,
                     first_program, decreasing, bad_ids, bad_weights):
    """Adds a program's counts to ``problems_ptr[0:4]`` (the summary kernel's four counts),
    only where ``counts_here`` and only those above 0 (most programs add nothing); the first
    program also checks that the offsets start at 0 and end at ``num_values``."""
    tl.atomic_add(problems_ptr, decreasing, mask=counts_here & (decreasing > 0))
    tl.atomic_add(problems_ptr + 1, bad_ids, mask=counts_here & (bad_ids > 0))
    tl.atomic_add(problems_ptr + 2, bad_weights, mask=counts_here & (bad_weights > 0))
    first_offset = tl.load(offsets_ptr, mask=first_program, other=0).to(tl.int64)
    last_offset = tl.load(offsets_ptr + num_bags, mask=first_program,
                          other=num_values).to(tl.int64)
    ends_off = (first_offset != 0) | (last_offset != num_values)
    tl.atomic_add(problems_ptr + 3, ends_off.to(tl.int64), mask=first_program & ends_off)


@triton.jit
def _inputs_clean(guard_ptr, GUARDED: tl.constexpr):
    """Whether the kernel may write: with ``GUARDED``, only if the four problem counts at
    ``guard_ptr`` (an input check whose answer the host has not read yet) are all 0."""
    problems = tl.zeros([], dtype=tl.int64)
    if GUARDED:
        problems = tl.sum(tl.load(guard_ptr + tl.arange(0, 4)))
    return problems == 0


# =========================================================================================
# Kernels
# =========================================================================================

@triton.jit(do_not_specialize=["p0", "p1", "p2", "key_limit"])
def _forward_kernel(
    w_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, out_ptr,
    batch, num_features, num_values, out_stride,
    p0: tl.int64, p1: tl.int64, p2: tl.int64, problems_ptr, key_limit: tl.int64, starts_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    CHECK: tl.constexpr, IN_BOUNDS: tl.constexpr, KEY_LIMIT: tl.constexpr,
    STARTS: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """out[b, OUT_OFFSET + j] = pool over the bag's ids of psw * W[idx(id, j)]; with
    ``STARTS`` the block starts are read from ``starts_ptr`` instead of hashed.

    With ``CHECK`` it also counts the input checks' problems into ``problems_ptr[0:4]``, as
    ``_input_summary_kernel`` does (the programs of column tile 0 read every id of their
    bag when every feature has a column), so the forward needs no launch of its own for them."""
    bag = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    b, out_offset, dim, w_offset, span, row_offset, lo, hi, divisor = _bag_setup(
        meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z, ACC)
    blk, s, cols, col_mask = _column_tile(tile, dim, Z, BLOCK_B, BLOCK_Z)
    if tile * BLOCK_B * Z >= dim:  # no column of this feature in the tile: skip the ids
        hi = lo
    num_rows = 0
    if CHECK and IN_BOUNDS:
        num_rows = tl.load(meta_ptr + _F_NUM_ROWS * _i64(num_features) + bag // batch)

    acc = tl.zeros([BLOCK_B, BLOCK_Z], dtype=ACC)
    bad_ids = tl.zeros([BLOCK_N], dtype=tl.int64)
    bad_weights = tl.zeros([BLOCK_N], dtype=tl.int64)
    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        id_mask = i < hi
        rows = _weighted_rows(w_ptr, values_ptr, psw_ptr, i, id_mask, col_mask, row_offset,
                              w_offset, span, blk, s, p0, p1, p2, HASH_MODE, HAS_PSW, ACC,
                              starts_ptr, STARTS, NUM_BLOCKS)
        acc += tl.sum(rows, axis=0)
        if CHECK:
            bad_ids, bad_weights = _count_value_problems(
                bad_ids, bad_weights, values_ptr, psw_ptr, i, id_mask, num_rows, row_offset,
                key_limit, HAS_PSW, IN_BOUNDS, KEY_LIMIT)

    acc = _div_rn(acc, divisor)
    tl.store(out_ptr + b * out_stride + out_offset + cols,
             acc.to(out_ptr.dtype.element_ty), mask=col_mask)
    if CHECK:
        raw_lo = tl.load(offsets_ptr + bag).to(tl.int64)
        raw_hi = tl.load(offsets_ptr + bag + 1).to(tl.int64)
        _report_problems(problems_ptr, offsets_ptr, batch * num_features, num_values,
                         tile == 0, (bag == 0) & (tile == 0), (raw_hi < raw_lo).to(tl.int64),
                         tl.sum(bad_ids), tl.sum(bad_weights))


@triton.jit(do_not_specialize=["p0", "p1", "p2", "key_limit"])
def _forward_short_bags_kernel(
    w_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, out_ptr,
    batch, num_features, num_values, out_stride,
    p0: tl.int64, p1: tl.int64, p2: tl.int64, problems_ptr, key_limit: tl.int64,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    CHECK: tl.constexpr, IN_BOUNDS: tl.constexpr, KEY_LIMIT: tl.constexpr,
    BLOCK_BAGS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """``_forward_kernel`` for short bags: a program pools ``BLOCK_BAGS`` consecutive bags
    of one feature (``program_id(0)`` = feature * groups + group) over one column tile
    (``program_id(1)``), walking their ids in step, one position at a time.

    A one-id bag is a short chain of dependent loads (offsets, id, hash, rows); one bag per
    program leaves the GPU waiting on that chain, several keep their loads in flight
    together. Sums run in id order: one- and two-id bags pool exactly as
    ``_forward_kernel`` does (bitwise). ``CHECK`` counts the input checks' problems as
    ``_forward_kernel`` does."""
    (b, out_offset, w_offset, span, row_offset, lo, hi, divisor, longest, blk, s, cols,
     col_mask, mask) = _short_bags_setup(meta_ptr, offsets_ptr, batch, num_features,
                                         num_values, Z, ACC, BLOCK_BAGS, BLOCK_B, BLOCK_Z)
    t = tl.program_id(0).to(tl.int64) // tl.cdiv(batch, BLOCK_BAGS)
    tile = tl.program_id(1)
    num_rows = 0
    if CHECK and IN_BOUNDS:
        num_rows = tl.load(meta_ptr + _F_NUM_ROWS * _i64(num_features) + t)
    acc = tl.zeros([BLOCK_BAGS, BLOCK_B, BLOCK_Z], dtype=ACC)
    bad_ids = tl.zeros([BLOCK_BAGS], dtype=tl.int64)
    bad_weights = tl.zeros([BLOCK_BAGS], dtype=tl.int64)
    for k in range(0, longest):
        i = lo + k
        id_mask = i < hi
        rows = _weighted_rows(w_ptr, values_ptr, psw_ptr, i, id_mask, col_mask, row_offset,
                              w_offset, span, blk, s, p0, p1, p2, HASH_MODE, HAS_PSW, ACC,
                              values_ptr, False, 1)
        acc += rows
        if CHECK:
            bad_ids, bad_weights = _count_value_problems(
                bad_ids, bad_weights, values_ptr, psw_ptr, i, id_mask, num_rows, row_offset,
                key_limit, HAS_PSW, IN_BOUNDS, KEY_LIMIT)

    acc = _div_rn(acc, divisor[:, None, None])
    tl.store(out_ptr + b[:, None, None] * out_stride + out_offset + cols[None, :, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)
    if CHECK:
        bag_mask = b < batch
        raw_lo = tl.load(offsets_ptr + t * batch + b, mask=bag_mask, other=0).to(tl.int64)
        raw_hi = tl.load(offsets_ptr + t * batch + b + 1, mask=bag_mask, other=0).to(tl.int64)
        decreasing = tl.sum(((raw_hi < raw_lo) & bag_mask).to(tl.int64))
        _report_problems(problems_ptr, offsets_ptr, batch * num_features, num_values,
                         tile == 0, (tl.program_id(0) == 0) & (tile == 0), decreasing,
                         tl.sum(bad_ids), tl.sum(bad_weights))


@triton.jit(do_not_specialize=["p0", "p1", "p2"])
def _backward_short_bags_kernel(
    grad_out_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, grad_w_ptr,
    batch, num_features, num_values, grad_stride,
    p0: tl.int64, p1: tl.int64, p2: tl.int64, guard_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    GUARDED: tl.constexpr, BLOCK_BAGS: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_Z: tl.constexpr,
):
    """``_backward_kernel`` for short bags, laid out as ``_forward_short_bags_kernel``:
    ``BLOCK_BAGS`` bags of one feature a program, their ids scattered in step."""
    (b, out_offset, w_offset, span, row_offset, lo, hi, divisor, longest, blk, s, cols,
     col_mask, mask) = _short_bags_setup(meta_ptr, offsets_ptr, batch, num_features,
                                         num_values, Z, ACC, BLOCK_BAGS, BLOCK_B, BLOCK_Z)
    longest = tl.where(_inputs_clean(guard_ptr, GUARDED), longest, 0)
    grad = tl.load(grad_out_ptr + b[:, None, None] * grad_stride + out_offset + cols[None, :, :],
                   mask=mask, other=0.0)
    grad = _div_rn(grad.to(ACC), divisor[:, None, None])
    for k in range(0, longest):
        i = lo + k
        id_mask = i < hi
        idx = _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
                               p0, p1, p2, HASH_MODE)
        contrib = grad
        if HAS_PSW:
            psw = tl.load(psw_ptr + i, mask=id_mask, other=0.0).to(ACC)
            contrib = contrib * psw[:, None, None]
        tl.atomic_add(grad_w_ptr + idx, contrib, mask=id_mask[:, None, None] & mask,
                      sem="relaxed")


@triton.jit(do_not_specialize=["p0", "p1", "p2"])
def _backward_kernel(
    grad_out_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, grad_w_ptr,
    batch, num_features, num_values, grad_stride,
    p0: tl.int64, p1: tl.int64, p2: tl.int64, guard_ptr, starts_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    GUARDED: tl.constexpr, STARTS: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """grad_w[idx(id, j)] += psw * grad_out[b, OUT_OFFSET + j] (/ bag size for MEAN)."""
    bag = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    b, out_offset, dim, w_offset, span, row_offset, lo, hi, divisor = _bag_setup(
        meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z, ACC)
    blk, s, cols, col_mask = _column_tile(tile, dim, Z, BLOCK_B, BLOCK_Z)
    if tile * BLOCK_B * Z >= dim:
        hi = lo
    hi = tl.where(_inputs_clean(guard_ptr, GUARDED), hi, lo)

    grad = tl.load(grad_out_ptr + b * grad_stride + out_offset + cols, mask=col_mask, other=0.0)
    grad = _div_rn(grad.to(ACC), divisor)
    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        id_mask = i < hi
        idx = _indices(values_ptr, starts_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
                       p0, p1, p2, HASH_MODE, STARTS, NUM_BLOCKS)
        mask = id_mask[:, None, None] & col_mask[None, :, :]
        contrib = tl.zeros([BLOCK_N, BLOCK_B, BLOCK_Z], dtype=ACC) + grad[None, :, :]
        if HAS_PSW:
            psw = tl.load(psw_ptr + i, mask=id_mask, other=0.0).to(ACC)
            contrib = contrib * psw[:, None, None]
        tl.atomic_add(grad_w_ptr + idx, contrib, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["p0", "p1", "p2"])
def _psw_grad_kernel(
    grad_out_ptr, w_ptr, values_ptr, offsets_ptr, meta_ptr, out_ptr,
    batch, num_features, num_values, grad_stride,
    p0: tl.int64, p1: tl.int64, p2: tl.int64, guard_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, ACC: tl.constexpr, GUARDED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """out[i] = <W row of values[i], grad_out row of its bag> (/ bag size for MEAN); 0
    where the guard finds the inputs bad."""
    bag = tl.program_id(0).to(tl.int64)
    b, out_offset, dim, w_offset, span, row_offset, lo, hi, divisor = _bag_setup(
        meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z, ACC)
    num_tiles = tl.cdiv(dim, BLOCK_B * Z)
    grad_row = grad_out_ptr + b * grad_stride + out_offset

    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        id_mask = i < hi
        dot = tl.zeros([BLOCK_N], dtype=ACC)
        for tile in range(0, num_tiles):
            blk, s, cols, col_mask = _column_tile(tile, dim, Z, BLOCK_B, BLOCK_Z)
            grad = tl.load(grad_row + cols, mask=col_mask, other=0.0).to(ACC)
            idx = _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, s,
                                   p0, p1, p2, HASH_MODE)
            mask = id_mask[:, None, None] & col_mask[None, :, :]
            rows = tl.load(w_ptr + idx, mask=mask, other=0.0).to(ACC)
            dot += tl.sum(tl.sum(rows * grad[None, :, :], axis=2), axis=1)
        dot = tl.where(_inputs_clean(guard_ptr, GUARDED), _div_rn(dot, divisor), 0.0)
        tl.store(out_ptr + i, dot.to(out_ptr.dtype.element_ty), mask=id_mask)


@triton.jit(do_not_specialize=["p0", "p1", "p2"])
def _hash_starts_kernel(
    values_ptr, offsets_ptr, meta_ptr, starts_ptr, batch, num_features, num_values,
    p0: tl.int64, p1: tl.int64, p2: tl.int64,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_NB: tl.constexpr,
):
    """starts[i, blk] = start of block ``blk`` of the id at position ``i`` (one bag a
    program): the hash once per id and block, for kernels that would otherwise hash it in
    every thread that reads the block."""
    bag = tl.program_id(0).to(tl.int64)
    b, out_offset, dim, w_offset, span, row_offset, lo, hi, divisor = _bag_setup(
        meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z, tl.float32)
    blk = tl.arange(0, BLOCK_NB).to(tl.int64)
    blk_mask = (blk < NUM_BLOCKS) & (blk * Z < dim)
    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        id_mask = i < hi
        ids = tl.load(values_ptr + i, mask=id_mask, other=0).to(tl.int64)
        start = _block_start((ids + row_offset)[:, None], blk[None, :], span, p0, p1, p2,
                             HASH_MODE)
        tl.store(starts_ptr + i[:, None].to(tl.int64) * NUM_BLOCKS + blk[None, :],
                 start.to(starts_ptr.dtype.element_ty),
                 mask=id_mask[:, None] & blk_mask[None, :])


@triton.jit
def _optimizer_kernel(
    w_ptr, grad_ptr, state1_ptr, state2_ptr, numel,
    lr: tl.float64, eps: tl.float64, beta2: tl.float64, weight_decay: tl.float64,
    lerp_weight: tl.float64, step_size: tl.float64, bias2_sqrt: tl.float64, guard_ptr,
    OPTIMIZER: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, COMPUTE: tl.constexpr,
    GUARDED: tl.constexpr, BLOCK: tl.constexpr,
):
    """One dense SGD / Adagrad / Adam step, elementwise, with torch.optim's formulas
    (see ``reference.apply_optimizer_``). Scalars arrive as float64 and are rounded to
    COMPUTE once, as torch rounds its Python-float scalars: ``lerp_weight = 1 - beta1``,
    ``step_size = -lr / (1 - beta1**step)``, ``bias2_sqrt = sqrt(1 - beta2**step)``."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < tl.where(_inputs_clean(guard_ptr, GUARDED), numel, 0)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(grad_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    if HAS_WEIGHT_DECAY:
        g = g + tl.full([], weight_decay, COMPUTE) * w
    if OPTIMIZER == _SGD:
        w = w + tl.full([], -lr, COMPUTE) * g
    elif OPTIMIZER == _ADAGRAD:
        state = tl.load(state1_ptr + i, mask=mask, other=0.0).to(COMPUTE) + g * g
        tl.store(state1_ptr + i, state.to(state1_ptr.dtype.element_ty), mask=mask)
        denom = _sqrt_rn(state) + tl.full([], eps, COMPUTE)
        w = w + tl.full([], -lr, COMPUTE) * _div_rn(g, denom)
    else:
        # exp_avg.lerp_(grad, 1 - beta1): torch's two-sided lerp formula
        exp_avg = tl.load(state1_ptr + i, mask=mask, other=0.0).to(COMPUTE)
        weight = tl.full([], lerp_weight, COMPUTE)
        if lerp_weight < 0.5:
            exp_avg = exp_avg + weight * (g - exp_avg)
        else:
            exp_avg = g - (g - exp_avg) * (1.0 - weight)
        # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg_sq = tl.load(state2_ptr + i, mask=mask, other=0.0).to(COMPUTE)
        exp_avg_sq = (exp_avg_sq * tl.full([], beta2, COMPUTE)
                      + tl.full([], 1.0 - beta2, COMPUTE) * (g * g))
        tl.store(state1_ptr + i, exp_avg.to(state1_ptr.dtype.element_ty), mask=mask)
        tl.store(state2_ptr + i, exp_avg_sq.to(state2_ptr.dtype.element_ty), mask=mask)
        denom = _div_rn(_sqrt_rn(exp_avg_sq), tl.full([], bias2_sqrt, COMPUTE))
        denom = denom + tl.full([], eps, COMPUTE)
        w = w + tl.full([], step_size, COMPUTE) * _div_rn(exp_avg, denom)
    tl.store(w_ptr + i, w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_adagrad_kernel(
    w_ptr, grad_ptr, sum_ptr, numel, num_rows,
    lr: tl.float64, eps: tl.float64, weight_decay: tl.float64, guard_ptr,
    Z: tl.constexpr, HAS_WEIGHT_DECAY: tl.constexpr, COMPUTE: tl.constexpr,
    GUARDED: tl.constexpr, ROWS: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """Row-wise Adagrad (see ``reference.apply_optimizer_``) on ``ROWS`` rows of ``Z``
    elements: ``sum[r] += mean over the row of g*g``, ``w -= lr * g / (sqrt(sum[r]) + eps)``."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None].to(tl.int64)
    j = tl.arange(0, BLOCK_Z)[None, :]
    i = r * Z + j
    clean = _inputs_clean(guard_ptr, GUARDED)
    mask = (j < Z) & (i < tl.where(clean, numel, 0))
    row_mask = r < tl.where(clean, num_rows, 0)
    w = tl.load(w_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    g = tl.load(grad_ptr + i, mask=mask, other=0.0).to(COMPUTE)
    if HAS_WEIGHT_DECAY:
        g = g + tl.full([], weight_decay, COMPUTE) * w
    count = tl.maximum(tl.minimum(numel - r * Z, Z), 1).to(COMPUTE)  # the last row is shorter
    state = tl.load(sum_ptr + r, mask=row_mask, other=0.0).to(COMPUTE)
    state = state + _div_rn(tl.sum(g * g, axis=1)[:, None], count)
    tl.store(sum_ptr + r, state.to(sum_ptr.dtype.element_ty), mask=row_mask)
    denom = _sqrt_rn(state) + tl.full([], eps, COMPUTE)
    w = w + tl.full([], -lr, COMPUTE) * _div_rn(g, denom)
    tl.store(w_ptr + i, w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["p0", "p1", "p2"])
def _block_starts_kernel(keys_ptr, out_ptr, num_keys, span, p0: tl.int64, p1: tl.int64,
                         p2: tl.int64, NUM_BLOCKS: tl.constexpr, HASH_MODE: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[k, blk] = start(keys[k], blk): the hash helpers on their own (tests, debugging)."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    blk = tl.arange(0, BLOCK_B)
    keys = tl.load(keys_ptr + k, mask=k < num_keys, other=0)
    span = _i64(span)
    start = _block_start(keys[:, None], blk[None, :].to(tl.int64), span, p0, p1, p2, HASH_MODE)
    mask = (k[:, None] < num_keys) & (blk[None, :] < NUM_BLOCKS)
    tl.store(out_ptr + k[:, None].to(tl.int64) * NUM_BLOCKS + blk[None, :], start, mask=mask)


@triton.jit
def _input_summary_kernel(values_ptr, offsets_ptr, psw_ptr, meta_ptr, out_ptr,
                          num_values, num_bags, batch, num_features, key_limit: tl.int64,
                          HAS_PSW: tl.constexpr, IN_BOUNDS: tl.constexpr,
                          KEY_LIMIT: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Counts the problems of the data-dependent input checks into ``out_ptr[0:4]``:
    decreasing bags, ids that fail their check, non-finite per-sample weights, and a first
    or last offset that is off. Program ``p`` checks bags and values ``[p * BLOCK, ...)``."""
    pid = tl.program_id(0).to(tl.int64)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    bag_mask = j < num_bags
    lo = tl.load(offsets_ptr + j, mask=bag_mask, other=0).to(tl.int64)
    hi = tl.load(offsets_ptr + j + 1, mask=bag_mask, other=0).to(tl.int64)
    tl.atomic_add(out_ptr, tl.sum((hi < lo).to(tl.int64)))
    value_mask = j < num_values
    if IN_BOUNDS or KEY_LIMIT:
        ids = tl.load(values_ptr + j, mask=value_mask, other=0).to(tl.int64)
        # feature of value j: how many feature ends offsets[(t + 1) * batch] are <= j
        # (binary search; offsets not yet known valid, so clamped to a real feature)
        first = tl.zeros([BLOCK], dtype=tl.int64)
        last = tl.zeros([BLOCK], dtype=tl.int64) + num_features
        for _ in range(SEARCH_STEPS):
            active = first < last
            mid = (first + last) // 2
            end = tl.load(offsets_ptr + (mid + 1) * batch, mask=value_mask & active,
                          other=0).to(tl.int64)
            right = end <= j
            first = tl.where(active & right, mid + 1, first)
            last = tl.where(active & ~right, mid, last)
        t = tl.minimum(first, num_features - 1)
        if IN_BOUNDS:
            rows = tl.load(meta_ptr + _F_NUM_ROWS * num_features + t, mask=value_mask, other=0)
            bad = (ids < 0) | (ids >= rows)
        else:
            row_offset = tl.load(meta_ptr + _F_ROW_OFFSET * num_features + t,
                                 mask=value_mask, other=0)
            bad = (ids < 0) | (ids + row_offset >= key_limit)
        tl.atomic_add(out_ptr + 1, tl.sum((bad & value_mask).to(tl.int64)))
    if HAS_PSW:
        w = tl.load(psw_ptr + j, mask=value_mask, other=0.0).to(tl.float64)
        nonfinite = (w != w) | (tl.abs(w) == float("inf"))
        tl.atomic_add(out_ptr + 2, tl.sum((nonfinite & value_mask).to(tl.int64)))
    if pid == 0:
        first_offset = tl.load(offsets_ptr).to(tl.int64)
        last_offset = tl.load(offsets_ptr + num_bags).to(tl.int64)
        tl.atomic_add(out_ptr + 3, ((first_offset != 0) | (last_offset != num_values)).to(tl.int64))


# =========================================================================================
# Host side
# =========================================================================================

def _is_interpreted(module) -> bool:
    return type(module._forward_kernel).__name__ == "InterpretedFunction"


def _kernels_for(device: torch.device):
    """This module, once checked that its kernels can run on ``device``.

    Triton decides when a kernel is decorated (at import) whether it is compiled or
    interpreted (``TRITON_INTERPRET``), and ``triton.language`` itself is imported one way or
    the other; a process cannot mix the two reliably. So CPU tensors need the whole process
    in interpreter mode: ``TRITON_INTERPRET=1`` set before triton is first imported.
    """
    if _TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            "robe: the Triton kernels need the `triton` package, which failed to import "
            f"({_TRITON_IMPORT_ERROR}); install triton or use another backend"
        )
    module = sys.modules[__name__]
    if device.type == "cuda":
        return module
    if device.type == "cpu" and _is_interpreted(module):
        return module
    raise RuntimeError(
        f"robe: the Triton kernels run on CUDA tensors, or on CPU tensors under Triton's "
        f"interpreter (set TRITON_INTERPRET=1 before triton is first imported); got "
        f"{device.type} tensors with the kernels compiled"
    )


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def _acc_dtype(weights: torch.Tensor):
    return tl.float64 if m.accumulation_dtype(weights.dtype) == torch.float64 else tl.float32


class _Tiles:
    """Constexpr tile sizes of a launch (powers of two, so few compiled variants), from the
    current :class:`~robe_torchrec.ops.tuning.TritonTuning`.

    One warp a program for the short-bags kernels unless the tuning says otherwise: their
    programs are many and short (the best in the H200 sweeps of
    ``benchmarks/results/triton_tiles_h200.md``). Several bags a program for bags of at most
    ``short_bag_mean`` ids: one bag at Z = 32, four at Z = 128 with dim 128 (the same
    sweeps). Bags of at least ``two_pass_mean_bag`` ids are pooled from block starts hashed
    in a pass of their own."""

    def __init__(self, max_dim: int, block_size: int, num_values: int, num_bags: int,
                 interpreted: bool = False):
        tuning = current_tuning()
        max_dim = max(int(max_dim), 1)
        num_blocks = -(-max_dim // block_size)
        self.num_blocks = num_blocks
        self.block_z = _next_pow2(min(block_size, max_dim))
        self.block_b = min(_next_pow2(num_blocks), max(1, tuning.col_tile // self.block_z))
        self.col_tiles = -(-num_blocks // self.block_b)
        mean_bag = num_values / max(num_bags, 1)
        self.short_bags = mean_bag <= tuning.short_bag_mean
        self.two_pass = not self.short_bags and mean_bag >= tuning.two_pass_mean_bag
        tile = (tuning.interpreter_tile if interpreted
                else tuning.two_pass_tile if self.two_pass else tuning.tile)
        self.block_n = min(_next_pow2(max(-(-num_values // max(num_bags, 1)), 1)),
                           max(1, tile // (self.block_b * self.block_z)))
        self.block_bags = tuning.bags_per_program or max(
            1, tuning.blocks_per_program // self.block_b)
        elements = self.block_n * self.block_b * self.block_z
        self.num_warps = tuning.num_warps or (
            tuning.two_pass_warps if self.two_pass
            else max(1, min(tuning.max_warps, elements // tuning.elements_per_warp)))
        self.short_bags_warps = tuning.num_warps or 1

    def kwargs(self):
        return dict(BLOCK_N=self.block_n, BLOCK_B=self.block_b, BLOCK_Z=self.block_z,
                    num_warps=self.num_warps)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.contiguous()`` without its call when it already is (host time a launch)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: a Triton function, slow to call from the host
    return -(-a // b)


def _hash_args(hash_params: List[int]):
    if len(hash_params) != 3:
        raise ValueError(f"robe: hash_params must hold 3 ints, got {len(hash_params)}")
    return [to_signed64(int(p)) for p in hash_params]


def _same_device(device: torch.device, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"robe: {name} is on {tensor.device} but weights are on {device}")


def _empty(*shape, dtype, device) -> torch.Tensor:
    out = torch.empty(*shape, dtype=dtype, device=device)
    if POISON_EMPTY:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


#: CPU table_meta -> (its version, its copy on the kernels' device)
_DEVICE_META: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _meta_on(table_meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table_meta`` on the kernels' device, copied once per tensor version when the caller
    keeps it elsewhere (a copy per call would wait on the host, and break a graph capture)."""
    if table_meta.device == device:
        return _dense(table_meta)
    hit = _DEVICE_META.get(table_meta)
    if hit is not None and hit[0] == table_meta._version and hit[1].device == device:
        return hit[1]
    copy = table_meta.to(device).contiguous()
    _DEVICE_META[table_meta] = (table_meta._version, copy)
    return copy


def _key_limit_arg(id_check: IdCheck) -> int:
    return 0 if id_check.key_limit is None else min(id_check.key_limit, 2**63 - 1)


def _id_check_constants(id_check: IdCheck) -> dict:
    return dict(IN_BOUNDS=id_check.in_bounds,
                KEY_LIMIT=id_check.key_limit is not None and not id_check.in_bounds)


def _launch_summary(values: torch.Tensor, offsets: torch.Tensor,
                    per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                    id_check: IdCheck) -> torch.Tensor:
    """The data-dependent input checks in one launch: four problem counts on the device
    (see :func:`robe_torchrec.ops.validation.check_inputs`)."""
    kernels = _kernels_for(values.device)
    num_bags = offsets.numel() - 1
    num_features = table_meta.shape[1]
    problems = torch.zeros(4, dtype=torch.int64, device=values.device)
    programs = _cdiv(max(values.numel(), num_bags, 1), _SUMMARY_BLOCK)
    psw = per_sample_weights
    kernels._input_summary_kernel[(programs,)](
        values.contiguous(), offsets.contiguous(), values if psw is None else psw.contiguous(),
        _meta_on(table_meta, values.device), problems,
        values.numel(), num_bags, num_bags // num_features, num_features,
        _key_limit_arg(id_check), HAS_PSW=psw is not None, **_id_check_constants(id_check),
        SEARCH_STEPS=num_features.bit_length(), BLOCK=_SUMMARY_BLOCK,
    )
    return problems


def _answer(problems: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
            meta_cpu: torch.Tensor, id_check: IdCheck) -> bool:
    """Whether the inputs whose problems a kernel counted (``problems``, its four counts on
    the device) pass, read at once, or ``True`` with the answer queued for a later call
    (:mod:`robe_torchrec.ops.deferred_checks`). Either way the backward ops of the same
    inputs reuse it."""
    if deferred_checks.deferred_for(values.device):
        deferred_checks.submit(problems, values, offsets, per_sample_weights, table_meta,
                               meta_cpu, id_check)
        return True
    clean = not any(problems.tolist())
    if clean:
        deferred_checks.remember_clean(values, offsets, per_sample_weights, meta_cpu,
                                       id_check)
    return clean


def _summarize_inputs(values: torch.Tensor, offsets: torch.Tensor,
                      per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                      meta_cpu: torch.Tensor, id_check: IdCheck) -> bool:
    """The summary kernel's answer (:func:`_answer`), for a forward whose kernel does not
    count the problems itself (see :func:`_counts_in_kernel`)."""
    deferred_checks.raise_ready()
    return _answer(_launch_summary(values, offsets, per_sample_weights, table_meta, id_check),
                   values, offsets, per_sample_weights, table_meta, meta_cpu, id_check)


def _counts_in_kernel(batch: int, output_dim: int, facts) -> bool:
    """Whether the forward kernel counts the input checks' problems (one launch less): when
    it reads every id, that is when it runs at all and every feature has a column."""
    return batch > 0 and output_dim > 0 and facts.min_dim > 0


def _backward_checks(grad_output: torch.Tensor, weights: torch.Tensor, values: torch.Tensor,
                     offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                     table_meta: torch.Tensor, block_size: int, hash_mode: int,
                     hash_params: List[int]):
    """The backward ops' checks, without waiting for the device: ``(meta_cpu, guard)``.

    ``guard`` is ``None`` when the inputs are known to pass (a problem raises here), else
    four problem counts on the device that the backward's kernels read before writing
    anything (see :mod:`robe_torchrec.ops.deferred_checks`): the forward's, when it
    checked these same inputs, or the summary kernel's."""
    guards: List[Optional[torch.Tensor]] = []

    def summarize(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check):
        deferred_checks.raise_ready()
        earlier = deferred_checks.earlier_check(values, offsets, per_sample_weights, meta_cpu,
                                                id_check)
        if earlier is not None:
            guards.append(earlier.guard())
            return True
        problems = _launch_summary(values, offsets, per_sample_weights, table_meta, id_check)
        if deferred_checks.deferred_for(values.device):
            deferred_checks.submit(problems, values, offsets, per_sample_weights, table_meta,
                                   meta_cpu, id_check)
            guards.append(problems)
            return True
        return not any(problems.tolist())  # read at once; bad input raises its message

    meta_cpu = check_backward_inputs(grad_output, weights, values, offsets, per_sample_weights,
                                     table_meta, block_size, hash_mode, hash_params, summarize)
    return meta_cpu, (guards[0] if guards else None)


def _guard_args(guard: Optional[torch.Tensor], any_tensor: torch.Tensor):
    """The kernels' guard argument and constant (any pointer will do when unguarded)."""
    return (any_tensor if guard is None else guard,), dict(GUARDED=guard is not None)


class _ForwardPlan(NamedTuple):
    """What a forward derives on the host from its static layout, computed once per layout
    (:func:`_forward_plan`)."""
    meta_cpu: torch.Tensor
    id_check: IdCheck
    params: List[int]
    batch: int
    counted: bool
    covers_output: bool
    tiles: "_Tiles"
    check_constants: dict
    key_limit: int


#: table_meta -> {everything else a plan depends on: plan}; weak keys, so a module's plan
#: lives as long as its table_meta
_PLANS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _forward_plan(weights, values, offsets, psw, table_meta, output_dim, block_size,
                  hash_mode, hash_params, bounds_check) -> _ForwardPlan:
    """The checked static layout of a forward call and its launch parameters, from the cache
    when an earlier call had the same layout: the same ``table_meta`` (and version), the same
    dtypes, shapes, devices and scalar arguments, the same tuning. A module calls with the
    same layout every step, and re-deriving it is most of a GPU forward's host time."""
    try:
        version = table_meta._version
    except RuntimeError:  # an inference tensor: no version to key on, so no cache
        version = None
    key = (version, weights.dtype, weights.shape, weights.device, values.dtype, values.shape,
           values.device, offsets.dtype, offsets.shape, offsets.device,
           None if psw is None else (psw.dtype, psw.shape, psw.device), output_dim,
           block_size, hash_mode, tuple(hash_params), bounds_check, current_tuning())
    plans = _PLANS.get(table_meta) if version is not None else None
    plan = None if plans is None else plans.get(key)
    if plan is not None:
        return plan
    kernels = _kernels_for(weights.device)
    _same_device(weights.device, values=values, offsets=offsets, per_sample_weights=psw)
    meta_cpu, id_check = check_layout(weights, values, offsets, psw, table_meta, output_dim,
                                      block_size, hash_mode, hash_params, bounds_check)
    num_bags = offsets.numel() - 1
    batch = num_bags // table_meta.shape[1]
    facts = meta_facts(meta_cpu, block_size, output_dim)
    counted = _counts_in_kernel(batch, output_dim, facts)
    tiles = _Tiles(facts.max_dim, block_size, values.numel(), num_bags,
                   _is_interpreted(kernels))
    if counted:
        check_constants, key_limit = dict(CHECK=True, **_id_check_constants(id_check)), \
            _key_limit_arg(id_check)
    else:  # the kernel never touches the problem counts
        check_constants, key_limit = dict(CHECK=False, IN_BOUNDS=False, KEY_LIMIT=False), 0
    plan = _ForwardPlan(meta_cpu, id_check, _hash_args(hash_params), batch, counted,
                        facts.covers_output, tiles, check_constants, key_limit)
    if version is not None:
        if plans is None:
            plans = _PLANS[table_meta] = {}
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return plan


#: plans kept per table_meta (batch sizes and tunings a module sees; beyond, start over)
_MAX_PLANS = 32


def forward(
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
) -> torch.Tensor:
    kernels = _kernels_for(weights.device)
    psw = per_sample_weights
    plan = _forward_plan(weights, values, offsets, psw, table_meta, output_dim, block_size,
                         hash_mode, hash_params, bounds_check)
    meta_cpu, id_check = plan.meta_cpu, plan.id_check
    if not plan.counted and not _summarize_inputs(values, offsets, psw, table_meta, meta_cpu,
                                                  id_check):
        check_data(values, offsets, psw, table_meta, meta_cpu, id_check)  # raises
    # columns no feature covers (output_dim > sum of dims) must read 0
    shape, dtype = (plan.batch, output_dim), m.accumulation_dtype(weights.dtype)
    out = (_empty(*shape, dtype=dtype, device=weights.device) if plan.covers_output
           else torch.zeros(shape, dtype=dtype, device=weights.device))
    if plan.batch == 0 or output_dim == 0:
        return out
    if plan.counted:
        deferred_checks.raise_ready()
        problems = torch.zeros(4, dtype=torch.int64, device=weights.device)
        check_args = (problems, plan.key_limit)
    else:  # any pointer will do
        check_args = (out, 0)
    _launch_bag_kernel((kernels._forward_kernel, kernels._forward_short_bags_kernel),
                       plan.tiles, weights, weights, out, values, offsets, psw, table_meta,
                       output_dim, block_size, hash_mode, plan.params, check_args,
                       plan.check_constants)
    # bad input made the kernel compute a wrong output but touch nothing outside its
    # tensors; the problem is raised here, or by a later call when the checks are deferred
    if plan.counted and not _answer(problems, values, offsets, psw, table_meta, meta_cpu,
                                    id_check):
        check_data(values, offsets, psw, table_meta, meta_cpu, id_check)  # raises
    return out


def _launch_bag_kernel(variants, tiles: _Tiles, source: torch.Tensor, weights: torch.Tensor,
                       target: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                       per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                       width: int, block_size: int, hash_mode: int, params: List[int],
                       extra_args: tuple = (), extra_constants: Optional[dict] = None) -> None:
    """Launch a bag kernel that reads ``source`` (weights, or the output gradient of ``width``
    columns) and writes ``target``: ``variants[1]`` (several short bags a program) when
    ``tiles`` says the bags are short, else ``variants[0]`` (one bag a program).
    ``extra_args`` and ``extra_constants`` are the forward kernels' check arguments."""
    num_features = table_meta.shape[1]
    num_bags = offsets.numel() - 1
    batch = num_bags // num_features
    psw = per_sample_weights
    args = (_dense(source), _dense(values), _dense(offsets),
            weights if psw is None else _dense(psw),
            _meta_on(table_meta, weights.device), target,
            batch, num_features, values.numel(), width, *params, *extra_args)
    constants = dict(Z=block_size, HASH_MODE=int(hash_mode), HAS_PSW=psw is not None,
                     ACC=_acc_dtype(weights), BLOCK_B=tiles.block_b, BLOCK_Z=tiles.block_z,
                     **(extra_constants or {}))
    per_bag, short_bags = variants
    if tiles.short_bags:
        grid = (num_features * _cdiv(batch, tiles.block_bags), tiles.col_tiles)
        short_bags[grid](*args, BLOCK_BAGS=tiles.block_bags, num_warps=tiles.short_bags_warps,
                         **constants)
        return
    starts = _hash_starts(values, offsets, table_meta, batch, block_size, hash_mode, params,
                          tiles, weights) if tiles.two_pass else values
    per_bag[(num_bags, tiles.col_tiles)](*args, starts, BLOCK_N=tiles.block_n,
                                         num_warps=tiles.num_warps, STARTS=tiles.two_pass,
                                         NUM_BLOCKS=tiles.num_blocks, **constants)


def _hash_starts(values: torch.Tensor, offsets: torch.Tensor, table_meta: torch.Tensor,
                 batch: int, block_size: int, hash_mode: int, params: List[int], tiles: _Tiles,
                 weights: torch.Tensor) -> torch.Tensor:
    """Every id's block starts, ``[num_values, tiles.num_blocks]``, hashed once (the first
    pass of a two-pass launch): int32 while every start fits, else int64."""
    kernels = _kernels_for(values.device)
    num_blocks = tiles.num_blocks
    fits = weights.numel() < 2**31  # every start lies below it
    starts = _empty(values.numel(), num_blocks, dtype=torch.int32 if fits else torch.int64,
                    device=values.device)
    num_bags = offsets.numel() - 1
    block_nb = _next_pow2(num_blocks)
    kernels._hash_starts_kernel[(num_bags,)](
        values.contiguous(), offsets.contiguous(), _meta_on(table_meta, values.device), starts,
        batch, table_meta.shape[1], values.numel(), *params, Z=block_size,
        HASH_MODE=int(hash_mode), NUM_BLOCKS=num_blocks,
        BLOCK_N=max(1, min(tiles.block_n, 1024 // block_nb)), BLOCK_NB=block_nb,
    )
    return starts


def hash_starts(weights: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                table_meta: torch.Tensor, max_dim: int, block_size: int, hash_mode: int,
                hash_params: List[int]) -> torch.Tensor:
    """Every id's block starts (``[num_values, ceil(max_dim / block_size)]``), as the first
    pass of a two-pass forward stores them; no input checks. For benchmarks and tests."""
    tiles = _Tiles(max_dim, block_size, values.numel(), offsets.numel() - 1,
                   _is_interpreted(_kernels_for(values.device)))
    batch = (offsets.numel() - 1) // table_meta.shape[1]
    return _hash_starts(values, offsets, table_meta, batch, block_size, hash_mode,
                        _hash_args(hash_params), tiles, weights)


def forward_from_starts(weights: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                        table_meta: torch.Tensor, output_dim: int, max_dim: int,
                        block_size: int, starts: torch.Tensor) -> torch.Tensor:
    """The second pass of a two-pass forward alone: the bags pooled from block starts
    computed beforehand (:func:`hash_starts`), no hash, no input checks, sum pooling as
    ``table_meta`` says. What reading the touched blocks and pooling them costs: a floor
    for benchmarks (never for untrusted input)."""
    kernels = _kernels_for(weights.device)
    num_bags = offsets.numel() - 1
    batch = num_bags // table_meta.shape[1]
    tiles = _Tiles(max_dim, block_size, values.numel(), num_bags, _is_interpreted(kernels))
    out = torch.zeros(batch, output_dim, dtype=m.accumulation_dtype(weights.dtype),
                      device=weights.device)
    kernels._forward_kernel[(num_bags, tiles.col_tiles)](
        weights, values, offsets, weights, _meta_on(table_meta, weights.device), out, batch,
        table_meta.shape[1], values.numel(), output_dim, 0, 0, 0, out, 0, starts,
        Z=block_size, HASH_MODE=0, HAS_PSW=False, ACC=_acc_dtype(weights), CHECK=False,
        IN_BOUNDS=False, KEY_LIMIT=False, STARTS=True, NUM_BLOCKS=tiles.num_blocks,
        **tiles.kwargs())
    return out


def _scatter_gradient(grad_output, weights, values, offsets, per_sample_weights, table_meta,
                      block_size, hash_mode, hash_params):
    """Checks, then the dense weight gradient in the accumulation dtype (fp32 / fp64), and
    the guard the checks left (see :func:`_backward_checks`): all zeros if it fails."""
    kernels = _kernels_for(weights.device)
    _same_device(weights.device, grad_output=grad_output, values=values, offsets=offsets,
                 per_sample_weights=per_sample_weights)
    meta_cpu, guard = _backward_checks(grad_output, weights, values, offsets,
                                       per_sample_weights, table_meta, block_size, hash_mode,
                                       hash_params)
    output_dim = grad_output.shape[1]
    params = _hash_args(hash_params)
    acc = m.accumulation_dtype(weights.dtype)
    grad = torch.zeros(weights.shape, dtype=acc, device=weights.device)  # atomics add into it
    if values.numel() == 0:
        return grad, guard
    tiles = _Tiles(meta_facts(meta_cpu, block_size, output_dim).max_dim, block_size,
                   values.numel(), offsets.numel() - 1, _is_interpreted(kernels))
    guard_args, guard_constants = _guard_args(guard, grad)
    _launch_bag_kernel((kernels._backward_kernel, kernels._backward_short_bags_kernel), tiles,
                       grad_output, weights, grad, values, offsets, per_sample_weights,
                       table_meta, output_dim, block_size, hash_mode, params, guard_args,
                       guard_constants)
    return grad, guard


def backward_dense(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    grad, _ = _scatter_gradient(grad_output, weights, values, offsets, per_sample_weights,
                                table_meta, block_size, hash_mode, hash_params)
    return grad.to(weights.dtype)


def per_sample_weights_grad(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    kernels = _kernels_for(weights.device)
    _same_device(weights.device, grad_output=grad_output, values=values, offsets=offsets)
    meta_cpu, guard = _backward_checks(grad_output, weights, values, offsets, None,
                                       table_meta, block_size, hash_mode, hash_params)
    num_features = table_meta.shape[1]
    batch = (offsets.numel() - 1) // num_features
    output_dim = grad_output.shape[1]
    params = _hash_args(hash_params)
    # every value lies in exactly one bag (offsets were checked), so every entry is written
    out = _empty(values.numel(), dtype=weights.dtype, device=weights.device)
    if values.numel() == 0:
        return out
    num_bags = offsets.numel() - 1
    tiles = _Tiles(meta_facts(meta_cpu, block_size, output_dim).max_dim, block_size,
                   values.numel(), num_bags,
                   _is_interpreted(kernels))
    guard_args, guard_constants = _guard_args(guard, out)
    kernels._psw_grad_kernel[(num_bags,)](
        grad_output.contiguous(), weights.contiguous(), values.contiguous(),
        offsets.contiguous(), _meta_on(table_meta, weights.device), out,
        batch, num_features, values.numel(), output_dim, *params, *guard_args,
        Z=block_size, HASH_MODE=int(hash_mode), ACC=_acc_dtype(weights), **tiles.kwargs(),
        **guard_constants,
    )
    return out


def backward_fused_(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    optimizer: int,
    hparams: List[float],
    step: int,
) -> None:
    optimizer = int(optimizer)
    check_optimizer_args(weights, state1, state2, optimizer, hparams, step, block_size)
    if optimizer == m.Optimizer.ADAM and deferred_checks.is_capturing():
        raise ValueError("robe: fused Adam cannot be captured in a CUDA graph: its bias "
                         "correction depends on the step, which a replay would repeat; "
                         "capture SGD, Adagrad or row-wise Adagrad, or leave the backward "
                         "out of the graph")
    grad, guard = _scatter_gradient(grad_output, weights, values, offsets, per_sample_weights,
                                    table_meta, block_size, hash_mode, hash_params)
    kernels = _kernels_for(weights.device)
    lr, eps, beta1, beta2, weight_decay = (float(h) for h in hparams)
    if optimizer == m.Optimizer.ADAM:
        step_size = -lr / (1.0 - beta1 ** step)
        bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    else:
        step_size, bias2_sqrt = 0.0, 1.0
    numel = weights.numel()
    if numel == 0:
        return
    guard_args, guard_constants = _guard_args(guard, grad)
    if optimizer == m.Optimizer.ROWWISE_ADAGRAD:
        num_rows = state1.numel()
        block_z = _next_pow2(block_size)
        rows = max(1, _OPTIM_BLOCK // block_z)
        kernels._rowwise_adagrad_kernel[(_cdiv(num_rows, rows),)](
            weights, grad, state1, numel, num_rows, lr, eps, weight_decay, *guard_args,
            Z=block_size, HAS_WEIGHT_DECAY=weight_decay != 0.0,
            COMPUTE=_acc_dtype(weights), ROWS=rows, BLOCK_Z=block_z, **guard_constants,
        )
        return
    uses = {m.Optimizer.SGD: 0, m.Optimizer.ADAGRAD: 1, m.Optimizer.ADAM: 2}[optimizer]
    kernels._optimizer_kernel[(_cdiv(numel, _OPTIM_BLOCK),)](
        weights, grad, state1 if uses >= 1 else weights, state2 if uses >= 2 else weights, numel,
        lr, eps, beta2, weight_decay, 1.0 - beta1, step_size, bias2_sqrt, *guard_args,
        OPTIMIZER=optimizer, HAS_WEIGHT_DECAY=weight_decay != 0.0,
        COMPUTE=_acc_dtype(weights), GUARDED=guard_constants["GUARDED"], BLOCK=_OPTIM_BLOCK,
    )


def block_starts(keys: torch.Tensor, num_blocks: int, memory_size: int, block_size: int,
                 mode: int, params: List[int]) -> torch.Tensor:
    """``[N, num_blocks]`` block starts computed by the kernels' hash helpers; the Triton twin
    of :func:`robe_torchrec.hashing.block_starts` (scalar ``memory_size``), for tests."""
    kernels = _kernels_for(keys.device)
    keys = keys.to(torch.int64).contiguous()
    out = _empty(keys.numel(), num_blocks, dtype=torch.int64, device=keys.device)
    if keys.numel() == 0 or num_blocks == 0:
        return out
    block_k = 64
    kernels._block_starts_kernel[(_cdiv(keys.numel(), block_k),)](
        keys, out, keys.numel(), int(memory_size) - int(block_size) + 1, *_hash_args(params),
        NUM_BLOCKS=int(num_blocks), HASH_MODE=int(mode), BLOCK_K=block_k,
        BLOCK_B=_next_pow2(num_blocks),
    )
    return out
