"""Every change robe_torchrec makes to TorchRec's (and torch's) behaviour, made in one place.

A ROBE module has one flat array where TorchRec expects tables, so a few TorchRec (and torch)
entry points need to know about it. :func:`install` makes those changes, each at most once,
and returns their names (:data:`CHANGES` says what each one does and why). ``import
robe_torchrec`` calls it when torchrec can be imported, so a user never has to; calling it
again changes nothing. No other robe_torchrec module changes anything when imported: each
change lives next to the code it installs, and only :func:`install` calls it.

It is safe without torchrec (a torch-only machine uses :mod:`robe_torchrec.ops` alone):
there is nothing to change there, and it returns ``()``.

Example::

    >>> import robe_torchrec
    >>> robe_torchrec.install()     # done on import already: the names of the changes in effect
    ('rowwise_adagrad', 'kjt_safe_global', 'default_sharders', 'dmp_unsharded_check',
     'ddp_fused_check', 'shard_unsharded_check', 'fp_sharder_check', 'quiet_torchrec_noise')
    >>> from robe_torchrec.installation import CHANGES
    >>> print(CHANGES["dmp_unsharded_check"])     # what one of them changes, and why
    DistributedModelParallel.__init__ is wrapped to raise UnshardedRobeModuleError, ...
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Tuple

#: name -> what the change does and why it is needed, in the order :func:`install` makes them
CHANGES: Dict[str, str] = {
    "rowwise_adagrad":
        "torchrec.optim.RowWiseAdagrad.__init__ and .step are wrapped so that "
        "apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ...) accepts a 1-D ROBE "
        "array (torchrec sizes its state from a 2-D table and raises IndexError) and leaves it "
        "to the module's fused optimizer (robe_torchrec.rowwise_install)",
    "kjt_safe_global":
        "torch.serialization.add_safe_globals([KeyedJaggedTensor]): torch.export.load reads a "
        "program exported on a KJT with weights-only loading instead of failing over to a "
        "full unpickle with a traceback in the log (robe_torchrec.export)",
    "default_sharders":
        "the get_default_sharders name in torchrec.distributed.model_parallel and "
        "torchrec.distributed.shard returns ours first (and our FP-EBC sharder in place of "
        "TorchRec's), so DistributedModelParallel(model) shards a ROBE module, also inside a "
        "FeatureProcessedEmbeddingBagCollection, with no sharders= "
        "(robe_torchrec.distributed.defaults)",
    "dmp_unsharded_check":
        "DistributedModelParallel.__init__ is wrapped to raise UnshardedRobeModuleError, "
        "naming the missing sharder and the fix, where DMP would leave a ROBE module unsharded "
        "in DDP, where it does not train (robe_torchrec.distributed.unsharded)",
    "ddp_fused_check":
        "torch.nn.parallel.DistributedDataParallel.__new__ is wrapped to raise "
        "UnshardedRobeModuleError for a model with a ROBE module whose array has an "
        "in-backward optimizer: each rank would update its array from its own batch and the "
        "ranks would drift apart silently; the error names the fix (DMP, or dense gradients "
        "under DDP) (robe_torchrec.distributed.unsharded)",
    "shard_unsharded_check":
        "torchrec.distributed.shard's shard() and shard_modules() raise "
        "UnshardedRobeModuleError for a model with a ROBE module: they would leave it "
        "unsharded (sharders without ours) or fail on their own unchanged-names check; the "
        "error says to use DistributedModelParallel (robe_torchrec.distributed.unsharded)",
    "fp_sharder_check":
        "TorchRec's FeatureProcessedEmbeddingBagCollectionSharder.shardable_parameters and "
        ".shard raise UnshardedRobeModuleError for a FeatureProcessedEmbeddingBagCollection "
        "around a ROBE module, naming the fix (our subclass of it, in get_default_sharders), "
        "where they would fail on a missing embedding_bags "
        "(robe_torchrec.distributed.unsharded)",
    "quiet_torchrec_noise":
        "logging and warnings filters for exactly the TorchRec messages printed per table "
        "and rank or about its own defaults when sharding; ROBE_TORCHREC_ALL_WARNINGS=1 "
        "shows them (robe_torchrec.quiet)",
}


def _installers() -> List[Tuple[str, Callable[[], bool]]]:
    # imported here, not at the top: they need torchrec, and this module must import without
    from robe_torchrec import quiet
    from robe_torchrec.distributed.defaults import install_default_sharder
    from robe_torchrec.distributed.unsharded import (install_ddp_check, install_dmp_check,
                                                     install_fp_sharder_check,
                                                     install_shard_check)
    from robe_torchrec.export import allow_kjt_in_saved_programs
    from robe_torchrec.rowwise_install import install_rowwise_adagrad

    return [("rowwise_adagrad", install_rowwise_adagrad),
            ("kjt_safe_global", allow_kjt_in_saved_programs),
            ("default_sharders", install_default_sharder),
            ("dmp_unsharded_check", install_dmp_check),
            ("ddp_fused_check", install_ddp_check),
            ("shard_unsharded_check", install_shard_check),
            ("fp_sharder_check", install_fp_sharder_check),
            ("quiet_torchrec_noise", quiet.install)]


def install() -> Tuple[str, ...]:
    """Make every change of :data:`CHANGES` not yet made; return the names of those in effect.

    Idempotent: each installer checks whether its change is already there, so a second call
    changes nothing and returns the same names. A change TorchRec gives no place for (a
    release without the function it wraps) is left out of the result rather than failing
    the import. Without torchrec, returns ``()``.
    """
    try:
        importlib.import_module("torchrec")
    except ImportError:
        return ()
    return tuple(name for name, installer in _installers() if installer())


__all__ = ["CHANGES", "install"]
