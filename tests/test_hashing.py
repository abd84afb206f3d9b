"""The hash module: reference test vectors, the mix hash's properties, tensor == scalar."""

import numpy as np
import pytest
import torch

from robe_torchrec.hashing import (
    REFERENCE_PRIME,
    HashMode,
    block_start_int,
    block_starts,
    hash_params,
    reference_block_terms,
    reference_constants,
    reference_key_limit,
)

# From the design notes: M = 1000, Z = 4, seed 1024, idx for j = 0..7
VECTORS = {
    0: [730, 731, 732, 733, 839, 840, 841, 842],
    1: [567, 568, 569, 570, 676, 677, 678, 679],
    12345: [832, 833, 834, 835, 941, 942, 943, 944],
    39999999: [972, 973, 974, 975, 84, 85, 86, 87],
    4000000000: [716, 717, 718, 719, 825, 826, 827, 828],
}


def test_reference_constants():
    assert reference_constants(1024) == (871205356, 1825252241, 634329019)


@pytest.mark.parametrize("key", sorted(VECTORS))
def test_reference_test_vectors(key):
    params = hash_params(HashMode.REFERENCE, 1024)
    starts = block_starts(torch.tensor([key]), 2, 1000, 4, HashMode.REFERENCE, params)[0]
    idx = [int(starts[j // 4]) + j % 4 for j in range(8)]
    assert idx == VECTORS[key]
    assert [block_start_int(key, j // 4, 1000, 4, HashMode.REFERENCE, params) + j % 4
            for j in range(8)] == VECTORS[key]


@pytest.mark.parametrize("mode", [HashMode.REFERENCE, HashMode.MIX])
def test_tensor_hash_equals_scalar_hash(mode):
    g = torch.Generator().manual_seed(int(mode))
    params = hash_params(mode, 99)
    keys = torch.randint(0, reference_key_limit(3, hash_params(HashMode.REFERENCE, 99)), (200,), generator=g)
    if mode == HashMode.MIX:
        keys = torch.cat([keys, torch.tensor([-1, -(2**63), 2**63 - 1])])
    for memory in (37, 1000, 2**32 + 3):
        got = block_starts(keys, 3, memory, 4, mode, params)
        want = [[block_start_int(int(k), b, memory, 4, mode, params) for b in range(3)] for k in keys]
        assert got.tolist() == want
        assert int(got.min()) >= 0 and int(got.max()) <= memory - 4


def test_mix_hash_is_uniform_and_blocks_independent():
    params = hash_params(HashMode.MIX, 1024)
    keys = torch.arange(200_000)
    starts = block_starts(keys, 2, 1000, 1, HashMode.MIX, params)
    counts = torch.bincount(starts[:, 0], minlength=1000).double()
    chi2 = float(((counts - 200.0) ** 2 / 200.0).sum())
    assert chi2 < 1200  # 999 dof: mean 999, sd ~45
    # rows colliding on block 0 should (almost) never collide on block 1
    a = block_starts(keys, 2, 100_003, 1, HashMode.MIX, params)
    order = torch.argsort(a[:, 0])
    s = a[order]
    pairs = (s[1:, 0] == s[:-1, 0])
    both = pairs & (s[1:, 1] == s[:-1, 1])
    assert int(pairs.sum()) > 100 and int(both.sum()) <= 2


def test_reference_hash_collisions_are_correlated():
    """The known weakness of the linear hash (documented in the README): measured here."""
    params = hash_params(HashMode.REFERENCE, 1024)
    a = block_starts(torch.arange(200_000), 2, 100_003, 1, HashMode.REFERENCE, params)
    order = torch.argsort(a[:, 0])
    s = a[order]
    pairs = s[1:, 0] == s[:-1, 0]
    both = pairs & (s[1:, 1] == s[:-1, 1])
    assert int(both.sum()) > 0.3 * int(pairs.sum())


def test_reference_key_limit_is_exact():
    params = hash_params(HashMode.REFERENCE, 1024)
    limit = reference_key_limit(4, params)
    a, b, c = params
    assert (limit - 1) * a + 3 * b + c < 2**63 <= limit * a + 3 * b + c


def test_hash_parse():
    assert HashMode.parse("mix") == HashMode.MIX
    with pytest.raises(ValueError, match="unknown ROBE hash"):
        HashMode.parse("md5")


@pytest.mark.parametrize("params", [hash_params(HashMode.REFERENCE, seed=1024),
                                    hash_params(HashMode.REFERENCE, seed=3),
                                    [5, 2**62 + 7, -3]],  # wraps in int64, as the kernels did
                         ids=["seed1024", "seed3", "out_of_range"])
def test_reference_block_terms_are_the_hash_of_key_zero(params):
    """The block terms the GPU kernels read are the reference hash of key 0, read where no
    fold by the span happens (span > P), and fit int32."""
    z = 4
    memory_size = REFERENCE_PRIME + z  # span P + 1: every start below P stays as it is
    terms = reference_block_terms(params, 40)
    if params[1] < 2**62:
        assert terms == [block_start_int(0, blk, memory_size, z, HashMode.REFERENCE, params)
                         for blk in range(40)]
    else:  # (blk * B + C) wrapped by int64 arithmetic, its remainder taken unsigned
        with np.errstate(over="ignore"):
            wrapped = np.arange(40, dtype=np.int64) * np.int64(params[1]) + np.int64(params[2])
        assert terms == (wrapped.view(np.uint64) % np.uint64(REFERENCE_PRIME)).tolist()
    assert all(0 <= t < REFERENCE_PRIME < 2**31 for t in terms)
