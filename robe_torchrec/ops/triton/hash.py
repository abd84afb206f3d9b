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
def _reference_start(key, term, span, a):
    """``((key * A + blk * B + C) mod P) mod span``, computed as
    ``((key * A) mod P + term) mod P`` with the block's ``term = (blk * B + C) mod P`` from
    the table the host makes once (``hashing.reference_block_terms``): the product's
    remainder once per key, none per block, then one compare to fold the sum back below P. Both
    remainders are below P < 2**31, so the sum and the remainder by ``span`` (where ``span``
    fits; a larger span leaves the sum as it is) are taken in 32 bits.

    Validated keys never overflow int64, so these are the reference's values exactly; a
    key that fails its check (reported later when checks are deferred) may wrap, and the
    unsigned remainders still land in ``[0, P)``, so that no start falls outside the
    array."""
    per_key = ((key * a).to(tl.uint64, bitcast=True) % _REFERENCE_PRIME).to(tl.uint32)
    h = per_key + term.to(tl.uint32, bitcast=True)
    h = tl.where(h >= _REFERENCE_PRIME, h - _REFERENCE_PRIME, h)
    span32 = tl.minimum(span, _REFERENCE_PRIME).to(tl.uint32)
    return tl.where(span > _REFERENCE_PRIME, h.to(tl.int64), (h % span32).to(tl.int64))


@triton.jit
def _mix_start(key, blk, span, salt):
    """``base = fmix64(key + salt)``, ``h = fmix64(base + (blk + 1) * GOLDEN)``,
    ``start = ((h >> 32) * span) >> 32``, all in uint64; returns int64."""
    base = _fmix64(key.to(tl.uint64, bitcast=True) + salt.to(tl.uint64, bitcast=True))
    h = _fmix64(base + (blk + 1).to(tl.uint64, bitcast=True) * _GOLDEN)
    start = ((h >> 32) * span.to(tl.uint64, bitcast=True)) >> 32
    return start.to(tl.int64, bitcast=True)


@triton.jit
def _block_terms(terms_ptr, blk, HASH_MODE: tl.constexpr):
    """The reference hash's block terms ``(blk * B + C) mod P`` of the blocks ``blk``, read
    from the host's table (int32, at least as long as the launch has blocks); the mix
    hash has none (zeros). Loaded once a program, before the id loop: every id of the
    program adds the same terms."""
    if HASH_MODE == _HASH_REFERENCE:
        terms = tl.load(terms_ptr + blk)
    else:
        terms = tl.zeros_like(blk).to(tl.int32)
    return terms


@triton.jit
def _block_start(key, blk, term, span, p0, HASH_MODE: tl.constexpr):
    """Start of block ``blk`` of hash key ``key`` (int64 tensors that broadcast together,
    with ``term`` the block's :func:`_block_terms`) under the hash parameter ``p0`` (a
    scalar kernel argument: A of the reference hash, the salt of the mix hash)."""
    p0 = _i64(p0)
    if HASH_MODE == _HASH_REFERENCE:
        start = _reference_start(key, term, span, p0)
    else:
        start = _mix_start(key, blk, span, p0)
    return start


@triton.jit(do_not_specialize=["p0"])
def _block_starts_kernel(keys_ptr, out_ptr, num_keys, span, p0: tl.int64, terms_ptr,
                         NUM_BLOCKS: tl.constexpr, HASH_MODE: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[k, blk] = start(keys[k], blk): the hash helpers on their own (tests, debugging)."""
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    blk = tl.arange(0, BLOCK_B)
    keys = tl.load(keys_ptr + k, mask=k < num_keys, other=0)
    span = _i64(span)
    blocks = blk[None, :].to(tl.int64)
    start = _block_start(keys[:, None], blocks, _block_terms(terms_ptr, blocks, HASH_MODE),
                         span, p0, HASH_MODE)
    mask = (k[:, None] < num_keys) & (blk[None, :] < NUM_BLOCKS)
    tl.store(out_ptr + k[:, None].to(tl.int64) * NUM_BLOCKS + blk[None, :], start, mask=mask)
