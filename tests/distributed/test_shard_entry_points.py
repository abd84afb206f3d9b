"""TorchRec's composable sharding entry points, ``torchrec.distributed.shard.shard_modules``
and ``shard``, never leave a ROBE module unsharded silently. They cannot shard one (their
check that the model keeps its parameter names fails on a sharded ROBE module), so for a
model with a ROBE module both raise ``UnshardedRobeModuleError`` up front, with or without
sharders, naming the missing sharder where it is missing and the fix
(``DistributedModelParallel`` with ``robe_torchrec.distributed.get_default_sharders()``),
whatever order things were imported in. Models without ROBE modules shard as before."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.shard import shard, shard_modules
from torchrec.distributed.sharding_plan import get_default_sharders as torchrec_defaults
from torchrec.distributed.sharding_plan import table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingCollection
from robe_torchrec.distributed import (
    ShardedRobeEmbeddingBagCollection,
    UnshardedRobeModuleError,
    get_default_sharders,
)
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

ROBE = RobeConfig(compression=10, block_size=4)
CPU = torch.device("cpu")
FIX = "DistributedModelParallel(model, sharders=robe_torchrec.distributed.get_default_sharders())"


def _ebc():
    ebc = common.make_ebc(ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    return ebc


def _case(rank: int, world: int, name: str) -> str:
    """What the entry point does with the case's model: the refusal's message, else the
    type the module was sharded into."""
    try:
        if name == "shard_modules_defaults":
            return type(shard_modules(common.Wrapper(_ebc()), device=CPU).ebc).__name__
        if name == "shard_modules_torchrec_list":
            model = shard_modules(common.Wrapper(_ebc()), device=CPU, sharders=torchrec_defaults())
            return type(model.ebc).__name__
        if name == "shard_modules_our_list_empty_plan":
            model = shard_modules(common.Wrapper(_ebc()), device=CPU, plan=ShardingPlan({}),
                                  sharders=get_default_sharders())
            return type(model.ebc).__name__
        if name == "shard_modules_top_level":
            return type(shard_modules(_ebc(), device=CPU)).__name__
        if name == "shard_modules_sequence":
            ec = RobeEmbeddingCollection(
                [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=100,
                                 feature_names=["f"])], ROBE)
            apply_optimizer_in_backward(torch.optim.Adagrad, [ec.weight], {"lr": 0.1})
            model = shard_modules(torch.nn.ModuleDict({"ec": ec}), device=CPU,
                                  sharders=[EmbeddingCollectionSharder()])
            return type(model["ec"]).__name__
        if name == "shard_no_sharder":
            return type(shard(_ebc(), table_wise(rank=0), device=CPU)).__name__
        if name == "shard_torchrec_sharder":
            return type(shard(_ebc(), table_wise(rank=0), device=CPU,
                              sharder=EmbeddingBagCollectionSharder())).__name__
        if name == "stock_model":
            stock = EmbeddingBagCollection(common.tables(), device=CPU)
            return type(shard_modules(common.Wrapper(stock), device=CPU).ebc).__name__
        if name == "the_fix":
            dmp = DistributedModelParallel(common.Wrapper(_ebc()), device=CPU,
                                           sharders=get_default_sharders())
            assert isinstance(dmp.module.ebc, ShardedRobeEmbeddingBagCollection)
            before = common.full_weight(dmp)
            dmp(common.local_slice(common.global_batch(0, world), rank)).sum().backward()
            change = (common.full_weight(dmp) - before).abs().max().item()
            return f"trained, array changed by {change:.3g}"
        raise ValueError(name)
    except UnshardedRobeModuleError as err:
        return f"refused: {err}"


REFUSED = {
    "shard_modules_defaults": r"^torchrec\.distributed\.shard\.shard_modules cannot shard "
                              r"RobeEmbeddingBagCollection 'ebc': after sharding it checks",
    "shard_modules_torchrec_list": r"^torchrec\.distributed\.shard\.shard_modules: sharders= "
                                   r"has no RobeEmbeddingBagCollectionSharder for "
                                   r"RobeEmbeddingBagCollection 'ebc', so shard_modules would "
                                   r"leave it unsharded, where it does not train \(its fused "
                                   r"optimizer would never step",
    "shard_modules_our_list_empty_plan": r"shard_modules cannot shard "
                                         r"RobeEmbeddingBagCollection 'ebc'",
    "shard_modules_top_level": r"shard_modules cannot shard RobeEmbeddingBagCollection "
                               r"\(the model itself\)",
    "shard_modules_sequence": r"sharders= has no RobeEmbeddingCollectionSharder for "
                              r"RobeEmbeddingCollection 'ec'",
    "shard_no_sharder": r"^torchrec\.distributed\.shard\.shard cannot shard "
                        r"RobeEmbeddingBagCollection \(the model itself\)",
    "shard_torchrec_sharder": r"^torchrec\.distributed\.shard\.shard: sharder= is "
                              r"EmbeddingBagCollectionSharder, not "
                              r"RobeEmbeddingBagCollectionSharder, for "
                              r"RobeEmbeddingBagCollection \(the model itself\); and even with",
}


@pytest.mark.slow
def test_shard_and_shard_modules_refuse_a_robe_module():
    # before: shard_modules with TorchRec's list returned the model with the ROBE module
    # unsharded; with the defaults it died in torch's "cannot modify FQNs" check; shard
    # asserted "Could not find a valid sharder type" or hit an AttributeError in TorchRec's
    # EBC sharder
    names = [*REFUSED, "stock_model", "the_fix"]
    for results in run_ranks(common.run_cases, 2, _case, names):
        for name, match in REFUSED.items():
            outcome = results[name]
            assert outcome.startswith("refused: "), (name, outcome)
            assert re.search(match, outcome.removeprefix("refused: ")), (name, outcome)
            assert FIX in outcome, (name, outcome)
        assert results["stock_model"] == "ShardedEmbeddingBagCollection", results["stock_model"]
        assert results["the_fix"].startswith("trained"), results["the_fix"]
        assert not results["the_fix"].endswith(" 0"), results["the_fix"]


_IMPORTED_FIRST = """
import sys
import torch, torch.distributed as dist
# shard_modules and TorchRec's default sharders are bound before robe_torchrec is imported
from torchrec.distributed.shard import shard, shard_modules
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec import EmbeddingBagConfig
from torchrec.optim import apply_optimizer_in_backward
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection

ebc = RobeEmbeddingBagCollection(
    [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])],
    RobeConfig(compression=10, block_size=4))
apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
model = torch.nn.ModuleDict({"sparse": ebc})
try:
    if sys.argv[1] == "shard_modules":
        model = shard_modules(model, device=torch.device("cpu"), sharders=get_default_sharders())
    else:
        model = torch.nn.ModuleDict({"sparse": shard(ebc, {}, device=torch.device("cpu"))})
except ValueError as err:
    print(type(err).__name__, err)
else:
    print("returned:", type(model["sparse"]).__name__)
"""


@pytest.mark.parametrize("entry", ["shard_modules", "shard"])
def test_entry_points_imported_before_robe_torchrec_refuse(entry):
    out = subprocess.run([sys.executable, "-c", _IMPORTED_FIRST, entry], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    # before: shard_modules returned with "sparse" still a RobeEmbeddingBagCollection
    assert last.startswith("UnshardedRobeModuleError"), last
    api = rf"torchrec\.distributed\.shard\.{entry}[ :]"
    assert re.match(rf"UnshardedRobeModuleError {api}", last), last
    assert FIX in last, last
