"""The tests' multi-process runner: :func:`robe_torchrec.distributed.spawn.run_ranks` (gloo,
one thread per rank)."""

from robe_torchrec.distributed.spawn import run_ranks

__all__ = ["run_ranks"]
