"""Everything that differs between the torchrec releases this project supports.

Supported: torchrec 1.6.1 to 1.8.0 (see ``pyproject.toml``). The rest of the project calls
TorchRec the same way on every supported release; where a release lacks what another has
and no public API covers both, the difference is handled here, and only here, so that
dropping an old release means deleting code from this one module. The TorchRec functions
that are private but have no public replacement are imported here too, so that one module
says what could break in the next release.

The adapters below do the right thing on every supported release without asking which one
is installed (where a release needs nothing, they do nothing), so a release that backports
a change is handled too. :func:`sharded_modules_wrap_data_parallel` says which behaviour the
installed release has, from what it has, not from its version number.

Example::

    >>> from robe_torchrec.torchrec_compat import TORCHREC_VERSION, undo_data_parallel_wrapping
    >>> TORCHREC_VERSION
    (1, 8, 0)
"""

from __future__ import annotations

import re
from typing import List, Tuple

import torchrec
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.train_pipeline import utils as _pipeline_utils

OLDEST_SUPPORTED: Tuple[int, int, int] = (1, 6, 1)
NEWEST_TESTED: Tuple[int, int, int] = (1, 8, 0)


def parse_version(text: str) -> Tuple[int, int, int]:
    """``"1.8.0"``, ``"1.6.1+cpu"`` or ``"1.9.0.dev20260101"`` as ``(major, minor, patch)``."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        raise ValueError(f"not a torchrec version: {text!r}")
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


TORCHREC_VERSION: Tuple[int, int, int] = parse_version(torchrec.__version__)


def sharded_modules_wrap_data_parallel(
        sharded_types: Tuple[type, ...] = (ShardedEmbeddingBagCollection,
                                           ShardedEmbeddingCollection)) -> bool:
    """Whether TorchRec's sharded embedding modules wrap their data-parallel lookups in
    ``DistributedDataParallel`` with no way for a subclass to say no.

    torchrec 1.8 does the wrapping in ``init_data_parallel``, which ROBE's sharded modules
    override to do nothing (their lookups all-reduce and apply the update inside backward).
    torchrec 1.6 does it inline in the constructor, so the wrapper has to be removed
    afterwards (:func:`undo_data_parallel_wrapping`).
    """
    return not all(hasattr(t, "init_data_parallel") for t in sharded_types)


def undo_data_parallel_wrapping(lookups: List[nn.Module]) -> None:
    """Replace, in place, every lookup that TorchRec's constructor wrapped in
    ``DistributedDataParallel`` with the lookup itself.

    ROBE's data-parallel lookups must not be under DDP: they all-reduce the array's gradient
    and apply the fused optimizer inside backward, leaving no gradient for DDP to reduce,
    and they are read directly (their ``weight``, ``segments`` and optimizer). The dropped
    wrapper never ran a forward, so it never prepared its reducer for a backward; what its
    constructor did (broadcast rank 0's initial lookup state to every rank) is redone by
    the sharded module, which fills every rank's arrays from rank 0's afterwards. On
    releases that do not wrap (1.8) there is nothing to replace.
    """
    for i, lookup in enumerate(lookups):
        if isinstance(lookup, DistributedDataParallel):
            lookups[i] = lookup.module


# TorchRec's train pipelines share these two steps as module-private functions; a pipeline
# subclass that reorders the steps has no public way to run them. They have the same
# signature in every supported release: tests/test_torchrec_compat.py checks it, so a release
# that renames or changes them fails there first.
start_embedding_lookup = _pipeline_utils._start_embedding_lookup
"""Start a pipelined module's lookup and output dist of the batch in ``context``:
``(module, context, source_stream, target_stream, stream_context)``."""

wait_for_events = _pipeline_utils._wait_for_events
"""Make ``stream`` wait for the events the pipeline recorded for a batch:
``(batch, context, stream)``."""

#: torchrec.distributed.shard's public ``shard`` / ``shard_modules`` do their work in these
#: module-private functions, looked up in that module at each call (whatever order things
#: were imported in): robe_torchrec.distributed.unsharded wraps them there. Both releases have
#: them (tests/distributed/test_shard_entry_points.py).
SHARD_IMPLEMENTATIONS: Tuple[str, str] = ("_shard", "_shard_modules")


__all__ = [
    "NEWEST_TESTED",
    "OLDEST_SUPPORTED",
    "SHARD_IMPLEMENTATIONS",
    "TORCHREC_VERSION",
    "parse_version",
    "sharded_modules_wrap_data_parallel",
    "start_embedding_lookup",
    "undo_data_parallel_wrapping",
    "wait_for_events",
]
