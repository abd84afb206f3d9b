"""A ROBE module that ``DistributedModelParallel`` would leave unsharded never trains
silently: TorchRec's own sharders list (``dlrm_main``: ``get_default_sharders`` imported before
robe_torchrec, given to the planner, then ``DistributedModelParallel(model, plan=plan)``) or a
hand-built list makes DMP raise an error that names the missing sharder and the fix (issue 31,
item 1)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.sharding_plan import get_default_sharders as torchrec_defaults
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim import apply_optimizer_in_backward

from robe_torchrec import RobeConfig, RobeEmbeddingCollection
from robe_torchrec.distributed import (
    RobeEmbeddingBagCollectionSharder,
    ShardedRobeEmbeddingBagCollection,
    UnshardedRobeModuleError,
    get_default_sharders,
)
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

ROBE = RobeConfig(compression=10, block_size=4)


def _model(device: str):
    ebc = common.make_ebc(ROBE, device=torch.device(device))
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    return common.Wrapper(ebc)


def _plan(model, world, sharders):
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"))
    return planner.collective_plan(model, sharders, dist.group.WORLD)


def _train_one_step(dmp, rank: int, world: int) -> str:
    before = dmp.state_dict()["ebc.weight"]
    before = common.full_tensor(before) if hasattr(before, "local_shards") else before.clone()
    out = dmp(common.local_slice(common.global_batch(0, world), rank))
    out.sum().backward()
    after = common.full_weight(dmp)
    return f"trained, array changed by {(after - before).abs().max().item():.3g}"


def _case(rank: int, world: int, name: str) -> str:
    """What DMP does with the case's model: the refusal's message, else one step's outcome."""
    try:
        if name in ("dlrm_main_meta", "dlrm_main_cpu"):
            model = _model("meta" if name.endswith("meta") else "cpu")
            dmp = DistributedModelParallel(model, plan=_plan(model, world, torchrec_defaults()),
                                           device=torch.device("cpu"))
        elif name == "hand_built_list":
            model = _model("cpu")
            dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                           sharders=[EmbeddingBagCollectionSharder()])
        elif name == "hand_built_plan_only":
            # the planner was given a hand-built list, DMP its (patched) defaults
            model = _model("cpu")
            plan = _plan(model, world, [EmbeddingBagCollectionSharder()])
            dmp = DistributedModelParallel(model, plan=plan, device=torch.device("cpu"))
        elif name == "sequence_without_its_sharder":
            ec = RobeEmbeddingCollection(
                [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=100,
                                 feature_names=["f"])], ROBE)
            apply_optimizer_in_backward(torch.optim.Adagrad, [ec.weight], {"lr": 0.1})
            DistributedModelParallel(
                torch.nn.ModuleDict({"ec": ec}), device=torch.device("cpu"),
                sharders=[RobeEmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
            return "sharded"
        elif name == "the_fix":
            # what the message says to do: our list for the planner, DMP's defaults
            model = _model("meta")
            dmp = DistributedModelParallel(model, plan=_plan(model, world, get_default_sharders()),
                                           device=torch.device("cpu"))
            assert isinstance(dmp.module.ebc, ShardedRobeEmbeddingBagCollection)
        else:
            raise ValueError(name)
        return _train_one_step(dmp, rank, world)
    except UnshardedRobeModuleError as err:
        return f"refused: {err}"


REFUSED = {
    "dlrm_main_meta": r"the plan has no entry for RobeEmbeddingBagCollection 'ebc'",
    "dlrm_main_cpu": r"the plan has no entry for RobeEmbeddingBagCollection 'ebc'",
    "hand_built_list": r"sharders= has no RobeEmbeddingBagCollectionSharder for "
                       r"RobeEmbeddingBagCollection 'ebc'",
    "hand_built_plan_only": r"the plan has no entry for RobeEmbeddingBagCollection 'ebc'",
    "sequence_without_its_sharder": r"sharders= has no RobeEmbeddingCollectionSharder for "
                                    r"RobeEmbeddingCollection 'ec'",
}


@pytest.mark.slow
def test_dmp_refuses_to_leave_a_robe_module_unsharded():
    # before: dlrm_main_meta "trained" with an array that never changed, dlrm_main_cpu died in
    # backward ("Cannot access accelerator device"), the others ran with the module in DDP
    names = [*REFUSED, "the_fix"]
    for results in run_ranks(common.run_cases, 2, _case, names):
        for name, match in REFUSED.items():
            outcome = results[name]
            assert outcome.startswith("refused: "), (name, outcome)
            assert re.search(match, outcome), (name, outcome)
            # the message names the fix, and says what would happen
            assert "robe_torchrec.distributed.get_default_sharders()" in outcome, outcome
            assert "does not train" in outcome, outcome
            assert "fused optimizer would never step" in outcome, outcome
        assert results["the_fix"].startswith("trained"), results["the_fix"]
        assert not results["the_fix"].endswith(" 0"), results["the_fix"]


_DLRM_MAIN_ORDER = """
import torch, torch.distributed as dist
# dlrm_main's imports: TorchRec's default sharders are bound before robe_torchrec is imported
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec import EmbeddingBagConfig
from torchrec.optim import apply_optimizer_in_backward
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection

ebc = RobeEmbeddingBagCollection(
    [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])],
    RobeConfig(compression=10, block_size=4), device=torch.device("meta"))
apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
model = torch.nn.ModuleDict({"sparse": ebc})
planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
plan = planner.collective_plan(model, get_default_sharders(), dist.group.WORLD)
try:
    DistributedModelParallel(model, plan=plan, device=torch.device("cpu"))
except ValueError as err:
    print(type(err).__name__, err)
else:
    print("sharded:", type(model["sparse"]).__name__)
"""


def test_dlrm_main_import_order_is_refused():
    out = subprocess.run([sys.executable, "-c", _DLRM_MAIN_ORDER], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("UnshardedRobeModuleError"), last
    assert "RobeEmbeddingBagCollection 'sparse'" in last
    assert "RobeEmbeddingBagCollectionSharder" in last



def test_a_managed_collision_module_around_a_robe_module_is_refused_with_the_fix():
    """TorchRec's ManagedCollisionEmbeddingCollection remaps raw ids into the rows of the
    collection it holds, and sharded, resets the rows of the ids it evicts. Around a ROBE
    module it runs unsharded as it does around a stock one; DMP refuses it (before: an
    AttributeError about ``embeddings`` from TorchRec's sharder), and what the message
    says to do instead, the raw ids hashed by the ROBE module itself, works."""
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy,
                                             ManagedCollisionCollection,
                                             MCHManagedCollisionModule)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tests.train.helpers import one_rank_group

    tables = [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=100,
                              feature_names=["f"])]
    raw_ids = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([12345, 2**40, 5]), lengths=torch.tensor([2, 1]))
    remapper = ManagedCollisionCollection(
        {"t": MCHManagedCollisionModule(zch_size=100, device=torch.device("cpu"),
                                        eviction_policy=DistanceLFU_EvictionPolicy(),
                                        eviction_interval=1, input_hash_size=2**50)}, tables)
    managed = ManagedCollisionEmbeddingCollection(
        RobeEmbeddingCollection(tables, ROBE), remapper)
    assert managed(raw_ids)[0]["f"].values().shape == (3, 8)
    with one_rank_group(), pytest.raises(UnshardedRobeModuleError) as refused:
        DistributedModelParallel(torch.nn.ModuleDict({"mc": managed}),
                                 device=torch.device("cpu"))
    message = str(refused.value)
    assert "ManagedCollisionEmbeddingCollection 'mc' holds RobeEmbeddingCollection" in message
    assert 'RobeConfig(bounds_check="unbounded", hash="mix")' in message
    fix = RobeEmbeddingCollection(tables, RobeConfig(compression=10, block_size=4,
                                                     bounds_check="unbounded", hash="mix"))
    assert fix(raw_ids)["f"].values().shape == (3, 8)


_PLAIN_DDP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim import apply_optimizer_in_backward
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

def model(fused):
    ebc = RobeEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])],
        RobeConfig(compression=10, block_size=4))
    if fused:
        apply_optimizer_in_backward(torch.optim.SGD, [ebc.weight], {"lr": 0.1})
    return torch.nn.ModuleDict({"sparse": ebc})

try:
    DistributedDataParallel(model(fused=True))
except ValueError as err:
    print(type(err).__name__, err)
dense = model(fused=False)
ddp = DistributedDataParallel(dense)
kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]))
ddp.module["sparse"](kjt).values().sum().backward()
print("dense gradient under DDP:", dense["sparse"].weight.grad is not None)
"""


def test_plain_ddp_refuses_an_array_with_an_in_backward_optimizer():
    """Plain DDP around a ROBE module whose array has an in-backward optimizer: each rank
    would update its array from its own batch, silently apart; refused, naming the fix. On
    dense gradients DDP takes the module as any other."""
    out = subprocess.run([sys.executable, "-c", _PLAIN_DDP], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    refused, dense = out.stdout.strip().splitlines()[-2:]
    assert refused.startswith("UnshardedRobeModuleError DistributedDataParallel: "
                              "RobeEmbeddingBagCollection 'sparse' has an in-backward "
                              "optimizer"), refused
    assert "drift apart" in refused and "get_default_sharders()" in refused, refused
    assert dense == "dense gradient under DDP: True", dense
