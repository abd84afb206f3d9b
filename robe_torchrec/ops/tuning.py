"""Launch parameters of the Triton kernels, in one typed place: what benchmarks vary (the
public seam for them; none patches the kernels' module).

The kernels' host wrappers read :func:`current` at every launch; :func:`tuned` changes it
for a block. Every value only changes how the work is cut into programs (tile sizes, warps,
which kernel variant pools the bags), never the result beyond float summation order: the
defaults are the fastest measured settings (docs/benchmarks.md says where), and a
benchmark sweeping them compares outputs too. ``answers_per_copy`` changes how soon a
deferred input check's problem is found, not what any op computes.

Example::

    >>> from robe_torchrec.ops.tuning import tuned
    >>> with tuned(num_warps=1, bags_per_program=4):
    ...     out = torch.ops.robe.forward(weights, values, offsets, None, meta, 24, 4, 0, params, 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    #: a column tile holds at most this many elements (``BLOCK_B * BLOCK_Z``)
    col_tile: int = 256
    #: an id x column tile holds at most this many elements (the id count adapts to the
    #: mean bag length)
    tile: int = 2048
    #: the same under Triton's interpreter, which pays per operation, not per element
    interpreter_tile: int = 16384
    #: warps of the bag kernels: one per this many elements of a tile, 1 to ``max_warps``
    elements_per_warp: int = 256
    max_warps: int = 4
    #: overrides the warp rule of every bag kernel when set
    num_warps: Optional[int] = None
    #: bags of at most this many ids on average are pooled several a program
    short_bag_mean: float = 2.0
    #: a short-bags program takes as many bags as make this many row blocks
    blocks_per_program: int = 4
    #: overrides that rule when set
    bags_per_program: Optional[int] = None
    #: bags of at least this many ids on average are pooled (and scattered) in two passes:
    #: the block starts of every id hashed once into a buffer, then read from it;
    #: ``float("inf")``: never. At 20 ids a bag, Z = 32, on an H100 the two-pass forward
    #: took 0.63x the one-pass forward's time (benchmarks/results/gpu_check_h100.md)
    two_pass_mean_bag: float = 4.0
    #: ``tile`` of the two-pass kernels: 8192 lets a bag of up to 32 ids (dim 128) be read
    #: in one step, which beat 2048 and 512 in the same run
    two_pass_tile: int = 8192
    #: warps of the two-pass kernels (``num_warps`` overrides it): 2 took 0.82x the time
    #: of 4 on the two-pass forward at 20 ids a bag, Z = 32, 8 took 1.94x (same run)
    two_pass_warps: int = 2
    #: the forward kernel counts the input checks' problems itself when it reads every id
    #: (one launch less); False: the summary kernel counts them first, as it once did
    #: (what a benchmark of the host's time per call sets this against)
    count_in_forward: bool = True
    #: the weight gradient summed in a fixed order, bitwise the same from run to run,
    #: instead of with float atomics (CUDA does this under
    #: ``torch.use_deterministic_algorithms(True)`` whatever this says)
    deterministic_backward: bool = False
    #: the bag kernels hash each (id, block) pair once, in a tile of its own, instead of in
    #: every thread that reads one of the block's columns (the same values either way).
    #: Compiled for an H100 the one-id forward then has fewer instructions a bag when a
    #: program pools several bags (``bags_per_program``), more with one
    #: (benchmarks/results/kernel_instructions.md); off until a GPU run measures it
    compact_hash: bool = False
    #: a compiled kernel variant is launched without ``JITFunction.run``'s per-call work
    #: (:mod:`robe_torchrec.ops.triton_launch`); False: every launch goes through it
    cached_launch: bool = True
    #: deferred input checks' answers copied to the host in one copy, with one event
    #: (:mod:`robe_torchrec.ops.answer_copies`): when a problem is found, not what the
    #: result is; 1: each answer copied on its own (a pinned buffer and an event a forward,
    #: as before copies were shared). 8 is not measured on a GPU yet: it spares 7 copies
    #: and events in 8 (two device calls each) for about 4 us of Python a forward on a CPU
    #: core (benchmarks/results/probes/answer_copies_ab.md); ``host_overhead --cuda``
    #: times both
    answers_per_copy: int = 8


_current = TritonTuning()


def current() -> TritonTuning:
    """The tuning the next launch uses."""
    return _current


@contextlib.contextmanager
def tuned(**changes) -> Iterator[TritonTuning]:
    """Launch with ``changes`` (fields of :class:`TritonTuning`) inside the block."""
    global _current
    previous = _current
    _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
