"""``RobeConfig``: how a collection of embedding tables is compressed into ROBE arrays.

Example::

    >>> from robe_torchrec import RobeConfig
    >>> RobeConfig(compression=1000, block_size=32)              # 1000x fewer floats
    >>> RobeConfig(memory_size=2**20, hash="mix", shared=False)  # 1 Mi floats split by table
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import List, Optional, Sequence

from robe_torchrec.hashing import HashMode
from robe_torchrec.ops.meta import BoundsCheck


@dataclasses.dataclass(frozen=True)
class RobeConfig:
    """Settings of ROBE-Z compression for a :class:`RobeEmbeddingBagCollection`.

    Args:
        memory_size: total floats of the ROBE array(s), at least ``block_size`` (per table with
            ``shared=False``); never exceeded. Give this or ``compression``.
        compression: ratio of the uncompressed size (sum of ``num_embeddings * embedding_dim``
            over the tables) to the ROBE size; ``memory_size = ceil(uncompressed / compression)``,
            each array rounded up to at least one block.
        block_size: Z, the number of contiguous floats read per hashed offset. Larger is faster
            and lets rows share more; the paper uses 1, 8, 32 or 128.
        hash: ``"reference"`` (the authors' hash, bit-exact; ids < ~1e10) or ``"mix"`` (64-bit
            mixing hash, any int64 id, independent offsets per block).
        seed: seed of the hash parameters (the reference uses 1024).
        shared: True: one array for all tables, table ``t`` hashing row ``i`` as key
            ``i + sum(num_embeddings of tables before t)`` (the paper's layout); the module then
            has exactly one parameter. False: one array per table, ``memory_size`` split in
            proportion to ``num_embeddings * embedding_dim``.
        init_scale: the arrays start uniform in ``[-init_scale, init_scale]`` (finite, >= 0);
            ``None`` means ``sqrt(1 / max(num_embeddings))``, the reference DLRM's
            initialisation, for arrays whose tables give no ``weight_init_min`` /
            ``weight_init_max`` or ``init_fn`` of their own (:mod:`robe_torchrec.table_init`).
        bounds_check: ``"error"`` (ids must lie in ``[0, num_embeddings)``, like TBE's FATAL
            mode) or ``"unbounded"`` (hash raw 64-bit ids as they come; pair with ``hash="mix"``).
    """

    memory_size: Optional[int] = None
    compression: Optional[float] = None
    block_size: int = 32
    hash: str = "reference"
    seed: int = 1024
    shared: bool = True
    init_scale: Optional[float] = None
    bounds_check: str = "error"

    def __post_init__(self) -> None:
        if (self.memory_size is None) == (self.compression is None):
            raise ValueError("RobeConfig: give exactly one of memory_size or compression (the "
                             "other None)")
        _check_int("block_size", self.block_size)
        _check_int("seed", self.seed)
        if self.memory_size is not None:
            _check_int("memory_size", self.memory_size)
        if self.compression is not None and not self.compression >= 1:
            raise ValueError(f"RobeConfig: compression must be >= 1, got {self.compression}")
        if self.block_size < 1:
            raise ValueError(f"RobeConfig: block_size must be >= 1, got {self.block_size}")
        if self.init_scale is not None and not (isinstance(self.init_scale, (int, float))
                                                and math.isfinite(self.init_scale)
                                                and self.init_scale >= 0):
            raise ValueError(f"RobeConfig: init_scale must be a finite number >= 0 (or None for "
                             f"sqrt(1 / max num_embeddings)), got {self.init_scale!r}")
        HashMode.parse(self.hash)
        self.bounds_check_mode  # validates the string
        # block_size >= 1 (above), so this also keeps memory_size positive
        if self.memory_size is not None and self.memory_size < self.block_size:
            raise ValueError(f"RobeConfig: memory_size={self.memory_size} holds less than one block "
                             f"of block_size={self.block_size} floats; give memory_size >= "
                             "block_size or a smaller block_size")

    @property
    def hash_mode(self) -> HashMode:
        return HashMode.parse(self.hash)

    @property
    def bounds_check_mode(self) -> BoundsCheck:
        try:
            return BoundsCheck[self.bounds_check.upper()]
        except KeyError:
            raise ValueError(f"RobeConfig: bounds_check must be 'error' or 'unbounded', "
                             f"got {self.bounds_check!r}") from None

    def total_memory(self, uncompressed: int) -> int:
        """Floats of ROBE memory for tables holding ``uncompressed`` floats in total."""
        if self.memory_size is not None:
            return int(self.memory_size)
        return max(1, math.ceil(uncompressed / float(self.compression)))

    def split_memory(self, table_sizes: Sequence[int]) -> List[int]:
        """Per-array sizes: one entry (shared) or one per table, each at least ``block_size``.

        An explicit ``memory_size`` is a budget: if it cannot give every array a block (in
        proportion to the tables' sizes), ``ValueError``; it is never silently exceeded.
        With ``compression`` an array smaller than one block is rounded up to one block."""
        total = self.total_memory(sum(table_sizes))
        if self.shared:
            return [max(total, self.block_size)]
        uncompressed = sum(table_sizes)
        sizes = [max(self.block_size, total * size // uncompressed) for size in table_sizes]
        # Hand the rounding remainder to the largest table so the budget is used exactly.
        largest = max(range(len(sizes)), key=lambda i: table_sizes[i])
        sizes[largest] = max(self.block_size, sizes[largest] + total - sum(sizes))
        if self.memory_size is not None and sum(sizes) > total:
            raise ValueError(f"RobeConfig: memory_size={total} cannot give each of the "
                             f"{len(sizes)} tables (shared=False) an array of at least "
                             f"block_size={self.block_size} floats; raise memory_size, lower "
                             "block_size or use shared=True")
        return sizes


def _check_int(name: str, value: object) -> None:
    # a float block size or memory size would flow into the kernels' integer arguments
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"RobeConfig: {name} must be an integer, got {value!r}")
