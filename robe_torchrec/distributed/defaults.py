"""The default sharders: TorchRec's plus :class:`RobeEmbeddingBagCollectionSharder` and
:class:`RobeEmbeddingCollectionSharder`, with TorchRec's ``FeatureProcessedEmbeddingBagCollection``
sharder replaced by :class:`RobeFeatureProcessedEmbeddingBagCollectionSharder`.

``DistributedModelParallel(model)`` without ``sharders=`` shards with TorchRec's
``get_default_sharders()``, which knows nothing of ROBE: the ROBE module would stay unsharded
inside DDP. :func:`robe_torchrec.install` (run on import) therefore calls
:func:`install_default_sharder`, which makes DMP's default list (and that of
``torchrec.distributed.shard``) start with our sharder. It wraps the name those two modules
call, not TorchRec's function itself (``torchrec.distributed.sharding_plan
.get_default_sharders`` is left as it is). It adds sharders for the module types TorchRec has
none for, and replaces TorchRec's feature-processed collection sharder by its subclass that
also takes a ROBE collection inside (and shards a stock one as TorchRec's does), so models
without ROBE modules are planned and sharded as before.

Example::

    >>> import robe_torchrec.distributed   # robe_torchrec.install() installed the default
    >>> dmp = DistributedModelParallel(model)                     # shards the ROBE module
    >>> dmp = DistributedModelParallel(model, sharders=get_default_sharders())  # the same
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, List

from torch import nn
from torchrec.distributed import sharding_plan
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.types import ModuleSharder

from robe_torchrec.distributed.fp_sharder import RobeFeatureProcessedEmbeddingBagCollectionSharder
from robe_torchrec.distributed.sequence_sharder import RobeEmbeddingCollectionSharder
from robe_torchrec.distributed.sharder import RobeEmbeddingBagCollectionSharder

#: the TorchRec modules whose ``get_default_sharders`` name gives DMP / ``shard`` their default
PATCHED_MODULES = ("torchrec.distributed.model_parallel", "torchrec.distributed.shard")


def get_default_sharders() -> List[ModuleSharder[nn.Module]]:
    """:class:`RobeEmbeddingBagCollectionSharder` and :class:`RobeEmbeddingCollectionSharder`
    followed by TorchRec's default sharders
    (``torchrec.distributed.sharding_plan.get_default_sharders()``), TorchRec's
    ``FeatureProcessedEmbeddingBagCollectionSharder`` replaced by
    :class:`RobeFeatureProcessedEmbeddingBagCollectionSharder`; fresh instances each call.

    Example::

        >>> DistributedModelParallel(model, sharders=get_default_sharders())
    """
    return _robe_and(sharding_plan.get_default_sharders())


def _robe_and(sharders: List[ModuleSharder[nn.Module]]) -> List[ModuleSharder[nn.Module]]:
    """Ours first, then ``sharders`` with each TorchRec FP-EBC sharder replaced by ours (the
    same codecs): DMP and the planner keep the last sharder of a module type, so a
    replacement, not an addition."""
    replaced = [RobeFeatureProcessedEmbeddingBagCollectionSharder(
        qcomm_codecs_registry=s.qcomm_codecs_registry)
        if type(s) is FeatureProcessedEmbeddingBagCollectionSharder else s for s in sharders]
    return [RobeEmbeddingBagCollectionSharder(), RobeEmbeddingCollectionSharder(), *replaced]


def _with_robe(torchrec_default: Callable[[], List[ModuleSharder[nn.Module]]]):
    @functools.wraps(torchrec_default)
    def default_sharders() -> List[ModuleSharder[nn.Module]]:
        return _robe_and(torchrec_default())

    default_sharders.robe_wraps = torchrec_default  # type: ignore[attr-defined]
    return default_sharders


def install_default_sharder() -> bool:
    """Make ``DistributedModelParallel``'s (and ``torchrec.distributed.shard``'s) default
    sharders include ours; True once they do. Idempotent; called by
    :func:`robe_torchrec.install` only.

    Example::

        >>> install_default_sharder()
        True
        >>> type(torchrec.distributed.model_parallel.get_default_sharders()[0]).__name__
        'RobeEmbeddingBagCollectionSharder'
    """
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        current = getattr(module, "get_default_sharders", None)
        if current is None or hasattr(current, "robe_wraps"):
            continue
        module.get_default_sharders = _with_robe(current)  # type: ignore[attr-defined]
    return True
