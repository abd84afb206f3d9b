"""The ROBE-Z hash functions: the single definition every kernel follows.

Element ``j`` of row ``i`` of table ``t`` is read from the ROBE array ``W`` at

    key   = i + row_offset[t]            (row_offset > 0 only for the shared layout)
    blk   = j // Z,   s = j % Z
    idx   = start(key, blk) + s          with 0 <= start(key, blk) <= M - Z

Two ``start`` functions exist (:class:`HashMode`):

* ``REFERENCE``: the ROBE-Z authors' CUDA hash, bit-exact::

      h = (key * A + blk * B + C) mod P          (int64, no intermediate mod)
      start = h mod (M - Z + 1)

  with ``P = 2038074743`` and ``A, B, C`` drawn by ``numpy.random.RandomState(seed)``.
  Keys must satisfy ``0 <= key * A + blk * B + C < 2**63`` (about 1.06e10 at most).

* ``MIX``: a 64-bit mixing hash valid for every int64 key, independent per block::

      base  = fmix64(key + salt)                          (wrapping uint64 arithmetic)
      h     = fmix64(base + (blk + 1) * GOLDEN)
      start = ((h >> 32) * (M - Z + 1)) >> 32             (multiply-shift range reduction)

  ``fmix64`` is MurmurHash3's finaliser and ``salt = fmix64(seed * GOLDEN)``. It needs
  ``M - Z + 1 < 2**32``.

This module holds the constants, the host-side parameter derivation and a vectorised
PyTorch implementation (the test oracle). The C++ and Triton kernels re-implement exactly
these formulas.

Example::

    >>> from robe_torchrec.hashing import HashMode, hash_params, block_starts
    >>> params = hash_params(HashMode.REFERENCE, seed=1024)
    >>> block_starts(torch.tensor([0]), num_blocks=2, memory_size=1000, block_size=4,
    ...              mode=HashMode.REFERENCE, params=params)
    tensor([[730, 839]])
"""

from __future__ import annotations

import enum
from functools import lru_cache
from typing import List, Tuple

import numpy as np
import torch

REFERENCE_PRIME = 2038074743
GOLDEN = 0x9E3779B97F4A7C15
FMIX_C1 = 0xFF51AFD7ED558CCD
FMIX_C2 = 0xC4CEB9FE1A85EC53
_U64 = (1 << 64) - 1


class HashMode(enum.IntEnum):
    """Which block-start hash a ROBE array uses. The integer is what the ops receive."""

    REFERENCE = 0
    MIX = 1

    @classmethod
    def parse(cls, value: "HashMode | str | int") -> "HashMode":
        if isinstance(value, HashMode):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(
                    f"unknown ROBE hash {value!r}: expected 'reference' or 'mix'"
                ) from None
        return cls(int(value))


def to_signed64(value: int) -> int:
    """Reinterpret an unsigned 64-bit integer as int64 (for tensors and op arguments)."""
    value &= _U64
    return value - (1 << 64) if value >= (1 << 63) else value


def fmix64_int(x: int) -> int:
    """MurmurHash3 fmix64 on Python ints (unsigned 64-bit semantics)."""
    x &= _U64
    x ^= x >> 33
    x = (x * FMIX_C1) & _U64
    x ^= x >> 33
    x = (x * FMIX_C2) & _U64
    x ^= x >> 33
    return x


@lru_cache(maxsize=None)
def reference_constants(seed: int) -> Tuple[int, int, int]:
    """``(A, B, C)`` of the reference hash, drawn exactly as the authors' code draws them."""
    draws = np.random.RandomState(seed).randint(0, REFERENCE_PRIME, 50)
    random_numbers = [REFERENCE_PRIME] + [int(v) for v in draws]
    return random_numbers[3], random_numbers[2], random_numbers[1]


def hash_params(mode: HashMode, seed: int) -> List[int]:
    """The three int64 hash parameters the ops take: ``[A, B, C]`` or ``[salt, 0, 0]``."""
    mode = HashMode.parse(mode)
    if mode == HashMode.REFERENCE:
        return list(reference_constants(int(seed)))
    salt = fmix64_int((int(seed) * GOLDEN) & _U64)
    return [to_signed64(salt), 0, 0]


def reference_key_limit(num_blocks: int, params: List[int]) -> int:
    """Exclusive bound on keys the reference hash computes without int64 overflow."""
    a, b, c = params
    return ((1 << 63) - 1 - c - max(num_blocks - 1, 0) * b) // a + 1


def reference_block_terms(params: List[int], num_blocks: int) -> List[int]:
    """``(blk * B + C) mod P`` for ``blk < num_blocks``: the part of the reference hash that
    depends on the block alone, which the GPU kernels read from a table made once for a
    module's tables instead of computing it in every program. Each is below ``P < 2**31``.
    The sum is taken as the kernels' int64 arithmetic takes it (wrapping), its remainder on
    the unsigned pattern, so that parameters outside ``[0, P)`` give what they always gave."""
    _, b, c = (to_signed64(int(p)) for p in params)
    return [((blk * b + c) & _U64) % REFERENCE_PRIME for blk in range(int(num_blocks))]


def block_start_int(
    key: int, blk: int, memory_size: int, block_size: int, mode: HashMode, params: List[int]
) -> int:
    """Scalar reference of one block start, on Python ints (used for test vectors)."""
    span = memory_size - block_size + 1
    if HashMode.parse(mode) == HashMode.REFERENCE:
        a, b, c = params
        return ((key * a + blk * b + c) % REFERENCE_PRIME) % span
    salt = params[0] & _U64
    base = fmix64_int((key & _U64) + salt)
    h = fmix64_int(base + (blk + 1) * GOLDEN)
    return ((h >> 32) * span) >> 32


# --- vectorised PyTorch implementation (int64 tensors emulate uint64 by wrapping) ---------

def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 holding uint64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 33)
    x = x * to_signed64(FMIX_C1)
    x = x ^ _shr(x, 33)
    x = x * to_signed64(FMIX_C2)
    return x ^ _shr(x, 33)


def block_starts(
    keys: torch.Tensor,
    num_blocks: int,
    memory_size: torch.Tensor | int,
    block_size: int,
    mode: HashMode,
    params: List[int],
) -> torch.Tensor:
    """Start offsets ``[N, num_blocks]`` (int64) of every block of every key.

    ``memory_size`` may be a scalar or a per-key tensor ``[N]`` (one array per table).
    """
    keys = keys.to(torch.int64).reshape(-1, 1)
    blk = torch.arange(num_blocks, dtype=torch.int64, device=keys.device).reshape(1, -1)
    if isinstance(memory_size, torch.Tensor):
        span = (memory_size.to(torch.int64) - block_size + 1).reshape(-1, 1)
    else:
        span = memory_size - block_size + 1
    if HashMode.parse(mode) == HashMode.REFERENCE:
        a, b, c = params
        return ((keys * a + blk * b + c) % REFERENCE_PRIME) % span
    base = _fmix64(keys + params[0])
    h = _fmix64(base + (blk + 1) * to_signed64(GOLDEN))
    return _mulhi32(_shr(h, 32), span)


def _mulhi32(hi: torch.Tensor, span: "torch.Tensor | int") -> torch.Tensor:
    """``(hi * span) >> 32`` for ``hi, span < 2**32`` without losing the top bit."""
    # hi * span can reach 2**64, which int64 cannot hold: split hi into 16-bit halves.
    return ((hi >> 16) * span + (((hi & 0xFFFF) * span) >> 16)) >> 16
