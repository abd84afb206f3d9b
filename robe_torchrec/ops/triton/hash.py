"""The hash helpers: the formulas of :mod:`robe_torchrec.hashing`, bit-exact (int64
arithmetic for the reference hash, uint64 wrapping multiplies and logical shifts for the mix
hash), and a kernel that runs them alone (tests)."""

from robe_torchrec.ops.triton.common import (
    _FMIX_C1,
    _FMIX_C2,
    _GOLDEN,
    _HASH_REFERENCE,
    _REFERENCE_PRIME,
    _i64,
    tl,
    triton,
)


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
def _block_start(key, blk, span, p0, p1, p2, HASH_MODE: tl.constexpr):
    """Start of block ``blk`` of hash key ``key`` (int64 tensors that broadcast together)
    under the hash parameters ``p0, p1, p2`` (scalar kernel arguments)."""
    p0, p1, p2 = _i64(p0), _i64(p1), _i64(p2)
    if HASH_MODE == _HASH_REFERENCE:
        start = _reference_start(key, blk, span, p0, p1, p2)
    else:
        start = _mix_start(key, blk, span, p0)
    return start


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
