"""Helpers shared by the bag kernels: a bag's feature and id range, its column tile and
element indices, and the input checks' problem counts."""

from robe_torchrec.ops.triton.common import (
    _F_DIM,
    _F_OUT_OFFSET,
    _F_POOLING,
    _F_ROW_OFFSET,
    _F_W_OFFSET,
    _F_W_SIZE,
    _MEAN,
    _i64,
    tl,
    triton,
)
from robe_torchrec.ops.triton.hash import _block_start


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
def _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, terms, s, p0,
                     HASH_MODE: tl.constexpr, COMPACT: tl.constexpr):
    """Flat indices ``[BLOCK_N, BLOCK_B, BLOCK_Z]`` into ``weights`` of the elements of the
    ids at positions ``i`` (``[BLOCK_N]``) for the blocks ``blk`` (``[BLOCK_B, 1]``, their
    :func:`_block_terms` ``terms``) and offsets ``s``.

    With ``COMPACT`` the ids are loaded a second time, as an ``[BLOCK_N, BLOCK_B]`` tile of
    their own, and each (id, block) pair is hashed there: Triton lays that tile out one
    pair a thread, then hands the starts to the gather's layout. Without it the hash runs
    in the gather's layout, which spreads a block's ``Z`` columns over the threads of a warp,
    so every one of them hashes the same pair (the same values either way)."""
    if COMPACT:
        blocks = tl.reshape(blk, (1, blk.shape[0]))
        pairs = i[:, None] + tl.zeros_like(blocks)
        in_tile = id_mask[:, None] & (blocks >= 0)  # the id mask broadcast to the tile
        ids = tl.load(values_ptr + pairs, mask=in_tile, other=0).to(tl.int64)
        start = _block_start(ids + row_offset, blocks, tl.reshape(terms, (1, blk.shape[0])),
                             span, p0, HASH_MODE)
        start = start[:, :, None]
    else:
        ids = tl.load(values_ptr + i, mask=id_mask, other=0).to(tl.int64)
        key = ids + row_offset  # wraps like the uint64 key of the mix hash
        start = _block_start(key[:, None, None], blk[None, :, :], terms[None, :, :], span, p0,
                             HASH_MODE)
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
def _indices(values_ptr, starts_ptr, i, id_mask, row_offset, w_offset, span, blk, terms, s,
             p0, HASH_MODE: tl.constexpr, STARTS: tl.constexpr, NUM_BLOCKS: tl.constexpr,
             COMPACT: tl.constexpr):
    """The elements' flat indices, hashed here or (``STARTS``) read from the stored starts."""
    if STARTS:
        idx = _stored_indices(starts_ptr, i, id_mask, w_offset, blk, s, NUM_BLOCKS)
    else:
        idx = _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, terms,
                               s, p0, HASH_MODE, COMPACT)
    return idx


@triton.jit
def _weighted_rows(w_ptr, values_ptr, psw_ptr, i, id_mask, col_mask, row_offset, w_offset,
                   span, blk, terms, s, p0, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr,
                   ACC: tl.constexpr, starts_ptr, STARTS: tl.constexpr,
                   NUM_BLOCKS: tl.constexpr, COMPACT: tl.constexpr):
    """The elements ``[N, BLOCK_B, BLOCK_Z]`` of the ids at positions ``i`` (``[N]``) in
    the column tile, times their per-sample weights; 0 where masked."""
    idx = _indices(values_ptr, starts_ptr, i, id_mask, row_offset, w_offset, span, blk, terms,
                   s, p0, HASH_MODE, STARTS, NUM_BLOCKS, COMPACT)
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
    program also checks that the offsets start at 0 and end at ``num_values``.

    One atomic of the four counts, not one each: Triton makes a scalar atomic in one thread
    and hands its result to the others through shared memory, a barrier each, which every
    program paid even with nothing to add. Relaxed: the counts are read after the kernel."""
    first_offset = tl.load(offsets_ptr, mask=first_program, other=0).to(tl.int64)
    last_offset = tl.load(offsets_ptr + num_bags, mask=first_program,
                          other=num_values).to(tl.int64)
    ends_off = ((first_offset != 0) | (last_offset != num_values)).to(tl.int64)
    which = tl.arange(0, 4)
    counted = tl.where(which == 0, decreasing, tl.where(which == 1, bad_ids, bad_weights))
    counts = tl.where(which == 3, ends_off, tl.where(counts_here, counted, 0))
    tl.atomic_add(problems_ptr + which, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _inputs_clean(guard_ptr, GUARDED: tl.constexpr):
    """Whether the kernel may write: with ``GUARDED``, only if the four problem counts at
    ``guard_ptr`` (an input check whose answer the host has not read yet) are all 0."""
    problems = tl.zeros([], dtype=tl.int64)
    if GUARDED:
        problems = tl.sum(tl.load(guard_ptr + tl.arange(0, 4)))
    return problems == 0
