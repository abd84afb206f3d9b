"""How the Triton bag kernels tile a launch: the constexpr tile sizes and warps of
:class:`Tiles`, chosen from the current :class:`~robe_torchrec.ops.tuning.TritonTuning`
and what a call's shapes say (the widest feature, the block size, the mean bag). Plain
Python on ints, kept apart from the launches that use it so that tests and benchmarks can
ask what a shape gets without launching anything.

Example::

    >>> tiles = Tiles(max_dim=128, block_size=32, num_values=2048, num_bags=2048)
    >>> tiles.short_bags, tiles.block_z, tiles.col_tiles
    (True, 32, 1)
"""

from __future__ import annotations

from robe_torchrec.ops.tuning import TritonTuning, current as current_tuning


def next_pow2(x: int) -> int:
    """The least power of two at or above ``x`` (1 for ``x <= 1``)."""
    return 1 << max(int(x) - 1, 0).bit_length()


def bag_lengths(num_values: int, num_bags: int, tuning: TritonTuning) -> tuple:
    """What a launch's tiles take from the number of ids a call looks up: whether the mean
    bag holds at most ``short_bag_mean`` ids (several bags a program), whether it holds at
    least ``two_pass_mean_bag`` (block starts hashed first), and the power of two at or
    above it rounded up (the id tile's bound). Calls whose bags hold more or fewer ids in
    all (multi-hot bags, whose count changes every batch) share a plan while these agree.
    A plain tuple: it is made on every call."""
    bags = num_bags if num_bags > 0 else 1
    mean_bag = num_values / bags
    short = mean_bag <= tuning.short_bag_mean
    ceil_mean = -(-num_values // bags)
    # next_pow2(max(ceil_mean, 1)), without its calls: this runs before every plan lookup
    return (short, not short and mean_bag >= tuning.two_pass_mean_bag,
            1 << (ceil_mean - 1).bit_length() if ceil_mean > 1 else 1)


class Tiles:
    """Constexpr tile sizes of a launch (powers of two, so few compiled variants), from the
    current :class:`~robe_torchrec.ops.tuning.TritonTuning`.

    One warp a program for the short-bags kernels unless the tuning says otherwise: their
    programs are many and short (the best in the H200 sweeps of
    ``benchmarks/results/history/triton_tiles_h200.md``). Several bags a program for bags of at most
    ``short_bag_mean`` ids: one bag at Z = 32, four at Z = 128 with dim 128 (the same
    sweeps). Bags of at least ``two_pass_mean_bag`` ids are pooled from block starts hashed
    in a pass of their own."""

    def __init__(self, max_dim: int, block_size: int, num_values: int, num_bags: int,
                 interpreted: bool = False):
        tuning = current_tuning()
        # the number of ids counts only through its bag lengths, which a plan's key holds
        short, two_pass, mean_pow2 = bag_lengths(num_values, num_bags, tuning)
        max_dim = max(int(max_dim), 1)
        num_blocks = -(-max_dim // block_size)
        self.num_blocks = num_blocks
        self.block_z = next_pow2(min(block_size, max_dim))
        self.block_b = min(next_pow2(num_blocks), max(1, tuning.col_tile // self.block_z))
        self.col_tiles = -(-num_blocks // self.block_b)
        self.short_bags = short
        self.two_pass = two_pass
        tile = (tuning.interpreter_tile if interpreted
                else tuning.two_pass_tile if self.two_pass else tuning.tile)
        self.block_n = min(mean_pow2, max(1, tile // (self.block_b * self.block_z)))
        self.block_bags = tuning.bags_per_program or max(
            1, tuning.blocks_per_program // self.block_b)
        elements = self.block_n * self.block_b * self.block_z
        self.num_warps = tuning.num_warps or (
            tuning.two_pass_warps if self.two_pass
            else max(1, min(tuning.max_warps, elements // tuning.elements_per_warp)))
        self.short_bags_warps = tuning.num_warps or 1
        self.compact_hash = tuning.compact_hash
        #: block terms a launch may read: every column tile's blocks, and the two-pass
        #: hash's power-of-two block range
        self.num_terms = max(self.col_tiles * self.block_b, next_pow2(num_blocks))

    def kwargs(self):
        return dict(BLOCK_N=self.block_n, BLOCK_B=self.block_b, BLOCK_Z=self.block_z,
                    num_warps=self.num_warps)
