"""The forward's kernels: pooling one bag a program or several short bags a program,
the first pass of a two-pass forward (every id's block starts, hashed once), and the input
checks' summary launch."""

from robe_torchrec.ops.triton.common import _F_NUM_ROWS, _F_ROW_OFFSET, _div_rn, _i64, tl, triton
from robe_torchrec.ops.triton.hash import _block_start, _block_terms
from robe_torchrec.ops.triton.bags import (
    _bag_setup,
    _column_tile,
    _count_value_problems,
    _report_problems,
    _short_bags_setup,
    _weighted_rows,
)


@triton.jit(do_not_specialize=["p0", "key_limit"])
def _forward_kernel(
    w_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, out_ptr,
    batch, num_features, num_values, out_stride,
    p0: tl.int64, terms_ptr, problems_ptr, key_limit: tl.int64, starts_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    CHECK: tl.constexpr, IN_BOUNDS: tl.constexpr, KEY_LIMIT: tl.constexpr,
    STARTS: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr, COMPACT: tl.constexpr,
    MEAN: tl.constexpr,
):
    """out[b, OUT_OFFSET + j] = pool over the bag's ids of psw * W[idx(id, j)]; with
    ``STARTS`` the block starts are read from ``starts_ptr`` instead of hashed. Without
    ``MEAN`` (no feature pools by its mean) nothing is divided.

    With ``CHECK`` it also counts the input checks' problems into ``problems_ptr[0:4]``, as
    ``_input_summary_kernel`` does (the programs of column tile 0 read every id of their
    bag when every feature has a column), so the forward needs no launch of its own for them."""
    bag = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    b, out_offset, dim, w_offset, span, row_offset, lo, hi, divisor = _bag_setup(
        meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z, ACC)
    blk, s, cols, col_mask = _column_tile(tile, dim, Z, BLOCK_B, BLOCK_Z)
    if STARTS:  # nothing hashed here
        terms = tl.zeros_like(blk).to(tl.int32)
    else:
        terms = _block_terms(terms_ptr, blk, HASH_MODE)
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
                              w_offset, span, blk, terms, s, p0, HASH_MODE, HAS_PSW, ACC,
                              starts_ptr, STARTS, NUM_BLOCKS, COMPACT)
        acc += tl.sum(rows, axis=0)
        if CHECK:
            bad_ids, bad_weights = _count_value_problems(
                bad_ids, bad_weights, values_ptr, psw_ptr, i, id_mask, num_rows, row_offset,
                key_limit, HAS_PSW, IN_BOUNDS, KEY_LIMIT)

    if MEAN:
        acc = _div_rn(acc, divisor)
    tl.store(out_ptr + b * out_stride + out_offset + cols,
             acc.to(out_ptr.dtype.element_ty), mask=col_mask)
    if CHECK:
        raw_lo = tl.load(offsets_ptr + bag).to(tl.int64)
        raw_hi = tl.load(offsets_ptr + bag + 1).to(tl.int64)
        _report_problems(problems_ptr, offsets_ptr, batch * num_features, num_values,
                         tile == 0, (bag == 0) & (tile == 0), (raw_hi < raw_lo).to(tl.int64),
                         tl.sum(bad_ids), tl.sum(bad_weights))


@triton.jit(do_not_specialize=["p0", "key_limit"])
def _forward_short_bags_kernel(
    w_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, out_ptr,
    batch, num_features, num_values, out_stride,
    p0: tl.int64, terms_ptr, problems_ptr, key_limit: tl.int64,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    CHECK: tl.constexpr, IN_BOUNDS: tl.constexpr, KEY_LIMIT: tl.constexpr,
    BLOCK_BAGS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr,
    COMPACT: tl.constexpr, MEAN: tl.constexpr,
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
    terms = _block_terms(terms_ptr, blk, HASH_MODE)
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
                              w_offset, span, blk, terms, s, p0, HASH_MODE, HAS_PSW, ACC,
                              values_ptr, False, 1, COMPACT)
        acc += rows
        if CHECK:
            bad_ids, bad_weights = _count_value_problems(
                bad_ids, bad_weights, values_ptr, psw_ptr, i, id_mask, num_rows, row_offset,
                key_limit, HAS_PSW, IN_BOUNDS, KEY_LIMIT)

    if MEAN:
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


@triton.jit(do_not_specialize=["p0"])
def _hash_starts_kernel(
    values_ptr, offsets_ptr, meta_ptr, starts_ptr, batch, num_features, num_values,
    p0: tl.int64, terms_ptr,
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
    terms = _block_terms(terms_ptr, blk, HASH_MODE)
    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        id_mask = i < hi
        ids = tl.load(values_ptr + i, mask=id_mask, other=0).to(tl.int64)
        start = _block_start((ids + row_offset)[:, None], blk[None, :], terms[None, :], span,
                             p0, HASH_MODE)
        tl.store(starts_ptr + i[:, None].to(tl.int64) * NUM_BLOCKS + blk[None, :],
                 start.to(starts_ptr.dtype.element_ty),
                 mask=id_mask[:, None] & blk_mask[None, :])


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
    decreasing = tl.sum((hi < lo).to(tl.int64))
    value_mask = j < num_values
    bad_ids = tl.zeros([], dtype=tl.int64)
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
        bad_ids += tl.sum((bad & value_mask).to(tl.int64))
    bad_weights = tl.zeros([], dtype=tl.int64)
    if HAS_PSW:
        w = tl.load(psw_ptr + j, mask=value_mask, other=0.0).to(tl.float64)
        nonfinite = (w != w) | (tl.abs(w) == float("inf"))
        bad_weights += tl.sum((nonfinite & value_mask).to(tl.int64))
    # one relaxed atomic of the four counts (see _report_problems); only the first program
    # checks the offsets' ends
    _report_problems(out_ptr, offsets_ptr, num_bags, num_values, True, pid == 0, decreasing,
                     bad_ids, bad_weights)
