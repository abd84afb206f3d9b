"""The backward's kernels: the weight gradient scattered with atomics (one bag a program,
or several short bags a program) and the per-sample-weight gradient."""

from robe_torchrec.ops.triton.common import _div_rn, tl, triton
from robe_torchrec.ops.triton.hash import _block_terms
from robe_torchrec.ops.triton.bags import (
    _bag_setup,
    _column_tile,
    _element_indices,
    _indices,
    _inputs_clean,
    _short_bags_setup,
)


@triton.jit(do_not_specialize=["p0"])
def _backward_short_bags_kernel(
    grad_out_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, grad_w_ptr,
    batch, num_features, num_values, grad_stride,
    p0: tl.int64, terms_ptr, guard_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    GUARDED: tl.constexpr, BLOCK_BAGS: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_Z: tl.constexpr, COMPACT: tl.constexpr, MEAN: tl.constexpr,
):
    """``_backward_kernel`` for short bags, laid out as ``_forward_short_bags_kernel``:
    ``BLOCK_BAGS`` bags of one feature a program, their ids scattered in step."""
    (b, out_offset, w_offset, span, row_offset, lo, hi, divisor, longest, blk, s, cols,
     col_mask, mask) = _short_bags_setup(meta_ptr, offsets_ptr, batch, num_features,
                                         num_values, Z, ACC, BLOCK_BAGS, BLOCK_B, BLOCK_Z)
    longest = tl.where(_inputs_clean(guard_ptr, GUARDED), longest, 0)
    terms = _block_terms(terms_ptr, blk, HASH_MODE)
    grad = tl.load(grad_out_ptr + b[:, None, None] * grad_stride + out_offset + cols[None, :, :],
                   mask=mask, other=0.0)
    grad = grad.to(ACC)
    if MEAN:
        grad = _div_rn(grad, divisor[:, None, None])
    for k in range(0, longest):
        i = lo + k
        id_mask = i < hi
        idx = _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk, terms,
                               s, p0, HASH_MODE, COMPACT)
        contrib = grad
        if HAS_PSW:
            psw = tl.load(psw_ptr + i, mask=id_mask, other=0.0).to(ACC)
            contrib = contrib * psw[:, None, None]
        tl.atomic_add(grad_w_ptr + idx, contrib, mask=id_mask[:, None, None] & mask,
                      sem="relaxed")


@triton.jit(do_not_specialize=["p0"])
def _backward_kernel(
    grad_out_ptr, values_ptr, offsets_ptr, psw_ptr, meta_ptr, grad_w_ptr,
    batch, num_features, num_values, grad_stride,
    p0: tl.int64, terms_ptr, guard_ptr, starts_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    GUARDED: tl.constexpr, STARTS: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr, COMPACT: tl.constexpr,
    MEAN: tl.constexpr,
):
    """grad_w[idx(id, j)] += psw * grad_out[b, OUT_OFFSET + j] (/ bag size for MEAN, where
    ``MEAN`` says some feature pools by its mean)."""
    bag = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    b, out_offset, dim, w_offset, span, row_offset, lo, hi, divisor = _bag_setup(
        meta_ptr, offsets_ptr, bag, batch, num_features, num_values, Z, ACC)
    blk, s, cols, col_mask = _column_tile(tile, dim, Z, BLOCK_B, BLOCK_Z)
    if STARTS:  # nothing hashed here
        terms = tl.zeros_like(blk).to(tl.int32)
    else:
        terms = _block_terms(terms_ptr, blk, HASH_MODE)
    if tile * BLOCK_B * Z >= dim:
        hi = lo
    hi = tl.where(_inputs_clean(guard_ptr, GUARDED), hi, lo)

    grad = tl.load(grad_out_ptr + b * grad_stride + out_offset + cols, mask=col_mask, other=0.0)
    grad = grad.to(ACC)
    if MEAN:
        grad = _div_rn(grad, divisor)
    for i0 in range(lo, hi, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        id_mask = i < hi
        idx = _indices(values_ptr, starts_ptr, i, id_mask, row_offset, w_offset, span, blk, terms,
                       s, p0, HASH_MODE, STARTS, NUM_BLOCKS, COMPACT)
        mask = id_mask[:, None, None] & col_mask[None, :, :]
        contrib = tl.zeros([BLOCK_N, BLOCK_B, BLOCK_Z], dtype=ACC) + grad[None, :, :]
        if HAS_PSW:
            psw = tl.load(psw_ptr + i, mask=id_mask, other=0.0).to(ACC)
            contrib = contrib * psw[:, None, None]
        tl.atomic_add(grad_w_ptr + idx, contrib, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["p0"])
def _psw_grad_kernel(
    grad_out_ptr, w_ptr, values_ptr, offsets_ptr, meta_ptr, out_ptr,
    batch, num_features, num_values, grad_stride,
    p0: tl.int64, terms_ptr, guard_ptr,
    Z: tl.constexpr, HASH_MODE: tl.constexpr, ACC: tl.constexpr, GUARDED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_Z: tl.constexpr, MEAN: tl.constexpr,
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
            terms = _block_terms(terms_ptr, blk, HASH_MODE)
            grad = tl.load(grad_row + cols, mask=col_mask, other=0.0).to(ACC)
            idx = _element_indices(values_ptr, i, id_mask, row_offset, w_offset, span, blk,
                                   terms, s, p0, HASH_MODE, False)
            mask = id_mask[:, None, None] & col_mask[None, :, :]
            rows = tl.load(w_ptr + idx, mask=mask, other=0.0).to(ACC)
            dot += tl.sum(tl.sum(rows * grad[None, :, :], axis=2), axis=1)
        if MEAN:
            dot = _div_rn(dot, divisor)
        dot = tl.where(_inputs_clean(guard_ptr, GUARDED), dot, 0.0)
        tl.store(out_ptr + i, dot.to(out_ptr.dtype.element_ty), mask=id_mask)


@triton.jit
def _gather_gradient_kernel(
    grad_out_ptr, psw_ptr, keys_ptr, order_ptr, src_ptr, lanes_ptr, divisor_ptr, bounds_ptr,
    grad_w_ptr, numel, num_tiles, guard_ptr,
    NUM_BLOCKS: tl.constexpr, HAS_PSW: tl.constexpr, ACC: tl.constexpr,
    GUARDED: tl.constexpr, TILE: tl.constexpr,
):
    """grad_w[j] for ``TILE`` consecutive elements ``j``, summed without atomics in a fixed
    order: the (id, block) pairs sorted by their block's first element (``keys_ptr``, ties
    in pair order, ``order_ptr`` their pair numbers ``i * NUM_BLOCKS + blk``), one pair at
    a time. The pairs whose block reaches the tile lie in ``bounds_ptr[tile],
    bounds_ptr[num_tiles + tile]``. Pair ``q`` adds ``grad_out[src[q] + r] / divisor[i] *
    psw[i]`` to element ``key + r`` for ``r < lanes[q]``, the contribution the atomic
    kernels add; 0 everywhere where the guard finds the inputs bad."""
    tile = tl.program_id(0).to(tl.int64)
    j = tile * TILE + tl.arange(0, TILE).to(tl.int64)
    lo = tl.load(bounds_ptr + tile)
    hi = tl.load(bounds_ptr + num_tiles + tile)
    hi = tl.where(_inputs_clean(guard_ptr, GUARDED), hi, lo)
    acc = tl.zeros([TILE], dtype=ACC)
    for p in range(lo, hi):
        q = tl.load(order_ptr + p)
        rel = j - tl.load(keys_ptr + p)
        lanes = tl.load(lanes_ptr + q)
        i = q // NUM_BLOCKS
        mask = (rel >= 0) & (rel < lanes)
        grad = tl.load(grad_out_ptr + tl.load(src_ptr + q) + rel, mask=mask, other=0.0)
        contrib = _div_rn(grad.to(ACC), tl.load(divisor_ptr + i))
        if HAS_PSW:
            contrib = contrib * tl.load(psw_ptr + i).to(ACC)
        acc += tl.where(mask, contrib, 0.0)
    tl.store(grad_w_ptr + j, acc, mask=j < numel)
