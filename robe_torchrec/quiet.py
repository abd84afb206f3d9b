"""Known TorchRec noise, filtered: the warnings ``DistributedModelParallel`` and the planner
print for every data-parallel table on every rank, and a few once-per-run ones about their
own defaults or torch APIs they call, none of which a user can act on.

:func:`install` adds filters for exactly these messages (nothing else TorchRec says is
hidden); :func:`robe_torchrec.install` calls it, so ``import robe_torchrec`` filters them.
Set ``ROBE_TORCHREC_ALL_WARNINGS=1`` to see them again: the log records check it at each
message, so it may be set at any time; the ``FutureWarning`` filters are added only if it is
unset when :func:`install` runs, so for those set it before importing robe_torchrec.

Example::

    >>> import robe_torchrec                         # robe_torchrec.install() ran quiet.install()
    >>> from robe_torchrec import quiet
    >>> quiet.installed()
    True
    >>> dmp = DistributedModelParallel(model)        # no "Sharding spec not found" x 26
"""

from __future__ import annotations

import logging
import os
import warnings

#: the environment variable that shows the filtered messages again
SHOW_ALL = "ROBE_TORCHREC_ALL_WARNINGS"

#: (logger name, message start) of the filtered log records. Per table and rank: the planner
#: (on the root logger) has no sharding spec for a data-parallel table, by design, and the
#: sharder has no cache for it. Once per run: DMP's own Topology, the planner's own storage
#: reservation, a one-process group without LOCAL_WORLD_SIZE, and torch's notice about
#: ``is_fx_tracing``, which TorchRec's KeyedJaggedTensor and KeyedTensor call when built.
NOISE_RECORDS = (
    ("root", "Sharding spec not found for "),
    ("torchrec.distributed.utils", "Sharding Type is data_parallel, caching params will be ignored"),
    ("torchrec.distributed.utils", "Compute Kernel is dense, caching params will be ignored"),
    ("torchrec.distributed.planner.types",
     "The topology was constructed directly rather than via TopologyFactory"),
    ("torchrec.distributed.planner.storage_reservations",
     "There is a known issue with TorchRec's dense tensor size calculation in dry run"),
    ("root", "Could not determine LOCAL_WORLD_SIZE from environment"),
    ("torch.fx._symbolic_trace", "is_fx_tracing will return true for both fx.symbolic_trace"),
)

#: (message regex, module regex) of the filtered ``FutureWarning`` s: the planner's default
#: storage reservation and DMP's default ``broadcast_buffers``, set by TorchRec, not the user
NOISE_WARNINGS = (
    (r"HeuristicalStorageReservation is known to cause issues", r"torchrec\.distributed\.planner"),
    (r"`broadcast_buffers` is deprecated", r"torchrec\.distributed\.model_parallel"),
)


class _KnownNoise(logging.Filter):
    def __init__(self, logger: str) -> None:
        super().__init__()
        self.starts = tuple(start for name, start in NOISE_RECORDS if name == logger)

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get(SHOW_ALL, "") not in ("", "0"):
            return True
        return not str(record.msg).startswith(self.starts)


_installed = False


def install() -> bool:
    """Filter the known noise (see the module docstring); later calls do nothing. True once
    the filters are in place. Called by :func:`robe_torchrec.install` only."""
    global _installed
    if _installed:
        return True
    _installed = True
    for name in dict.fromkeys(name for name, _ in NOISE_RECORDS):
        logging.getLogger(None if name == "root" else name).addFilter(_KnownNoise(name))
    if os.environ.get(SHOW_ALL, "") in ("", "0"):
        for message, module in NOISE_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning,
                                    module=module)
    return True


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


__all__ = ["NOISE_RECORDS", "NOISE_WARNINGS", "SHOW_ALL", "install", "installed"]
