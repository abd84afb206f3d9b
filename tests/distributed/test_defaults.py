"""Sharding with no extra knobs: ``DistributedModelParallel(model)`` with its default sharders
shards the ROBE module (never an unsharded module inside DDP), ``get_default_sharders()`` is
TorchRec's list plus ours, extra KJT features are ignored as TorchRec's sharded EBC ignores
them, and a bad id names the user's feature, not the sharded lookup's index."""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed import model_parallel
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import get_default_sharders as torchrec_defaults
from torchrec.optim import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec import RobeConfig
from robe_torchrec.distributed import (
    RobeEmbeddingBagCollectionSharder,
    RobeEmbeddingCollectionSharder,
    RobeFeatureProcessedEmbeddingBagCollectionSharder,
    ShardedRobeEmbeddingBagCollection,
    get_default_sharders,
    install_default_sharder,
)
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

ROBE = RobeConfig(compression=10, block_size=4, shared=False)


def test_get_default_sharders_is_ours_plus_torchrecs():
    sharders = get_default_sharders()
    assert [type(s) for s in sharders[:2]] == [RobeEmbeddingBagCollectionSharder,
                                                RobeEmbeddingCollectionSharder]
    # TorchRec's feature-processed collection sharder replaced by ours, a subclass of it
    expected = [RobeFeatureProcessedEmbeddingBagCollectionSharder
                if s is FeatureProcessedEmbeddingBagCollectionSharder else s
                for s in map(type, torchrec_defaults())]
    assert [type(s) for s in sharders[2:]] == expected
    assert RobeFeatureProcessedEmbeddingBagCollectionSharder in expected


def test_dmp_default_sharders_include_ours_once():
    install_default_sharder()  # idempotent: already installed by the import
    install_default_sharder()
    defaults = model_parallel.get_default_sharders()
    assert [type(s) for s in defaults].count(RobeEmbeddingBagCollectionSharder) == 1
    assert [type(s) for s in defaults].count(RobeEmbeddingCollectionSharder) == 1
    assert len(defaults) == len(torchrec_defaults()) + 2


def _dmp_step(rank: int, world: int, explicit: bool):
    ebc = common.make_ebc(ROBE)
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
    kwargs = {"sharders": get_default_sharders()} if explicit else {}
    dmp = DistributedModelParallel(common.Wrapper(ebc), **kwargs)
    sharded = dmp.module.ebc
    types = {n: ps.sharding_type for n, ps in sharded.module_sharding_plan.items()}
    ref = common.make_ebc(ROBE)
    weight = ref.weight.detach().clone().requires_grad_(True)
    opt = torch.optim.Adagrad([weight], lr=0.1)
    worst = 0.0
    for step in range(2):
        kjt = common.global_batch(step, world)
        lo, hi = rank * common.B, (rank + 1) * common.B
        tgt = common.target(step, world * common.B, 24)
        out = dmp(common.local_slice(kjt, rank))
        (0.5 * ((out - tgt[lo:hi]) ** 2).sum()).backward()
        ref_kt = torch.func.functional_call(ref, {"weight": weight}, (kjt,)).to_dict()
        ref_out = torch.cat([ref_kt[f] for f in common.FEATURES], dim=1)
        (0.5 * ((ref_out - tgt) ** 2).sum() / world).backward()  # rank-averaged, as TorchRec
        opt.step()
        opt.zero_grad()
        worst = max(worst, (out.detach() - ref_out[lo:hi].detach()).abs().max().item())
    return isinstance(sharded, ShardedRobeEmbeddingBagCollection), types, worst


@pytest.mark.slow
@pytest.mark.parametrize("explicit", [False, True], ids=["dmp_defaults", "get_default_sharders"])
def test_dmp_shards_robe_without_a_sharders_argument(explicit):
    for is_sharded, types, worst in run_ranks(_dmp_step, 2, explicit):
        assert is_sharded
        assert set(types.values()) <= {"data_parallel", "table_wise"}, types
        assert worst <= 1e-5, worst


def _extra_feature(rank: int, world: int):
    # two identical modules: a sharded EBC fixes its input dist on the first batch's keys
    with_extra, without = [
        common.make_dmp(ROBE, {"t0": "table_wise", "t1": "data_parallel", "t2": "row_wise"},
                        world, optimizer=(torch.optim.SGD, {"lr": 0.0})) for _ in range(2)]
    kjt = common.local_slice(common.global_batch(0, world), rank)
    extra = KeyedJaggedTensor.from_lengths_sync(
        ["extra", *kjt.keys()], torch.cat([torch.tensor([10**9, 7]), kjt.values()]),
        torch.cat([torch.tensor([2] + [0] * (common.B - 1)), kjt.lengths()]))
    return (with_extra(extra) - without(kjt)).abs().max().item()


@pytest.mark.slow
def test_sharded_module_ignores_extra_features():
    # as TorchRec's ShardedEmbeddingBagCollection: a feature no table reads is dropped
    for diff in run_ranks(_extra_feature, 2):
        assert diff == 0.0


def _bad_id(rank: int, world: int, types):
    dmp = common.make_dmp(ROBE, types, world, optimizer=(torch.optim.SGD, {"lr": 0.1}))
    kjt = common.local_slice(common.global_batch(0, world), rank)
    values = kjt.values().clone()
    f3 = kjt["f3"]
    assert f3.values().numel() > 0
    values[kjt.offset_per_key()[3]] = 10**6  # f3's table has 300 rows
    dmp(KeyedJaggedTensor.from_lengths_sync(kjt.keys(), values, kjt.lengths()))


@pytest.mark.slow
@pytest.mark.parametrize("world,types", [
    # f3 is the table-wise lookup's feature 1 (after f0)
    (1, {"t0": "table_wise", "t1": "data_parallel", "t2": "table_wise"}),
    # every rank sees the bad id in its data-parallel lookup (so no rank waits on another)
    (2, {"t0": "table_wise", "t1": "table_wise", "t2": "data_parallel"}),
    # TorchRec buckets an id past the table to rank id % world, as a local id: the message
    # names the feature, the table's range and the rank's rows
    (2, {"t0": "table_wise", "t1": "table_wise", "t2": "row_wise"}),
], ids=["table_wise", "data_parallel", "row_wise"])
def test_sharded_id_error_names_the_feature(world, types):
    match = r"feature 'f3'.* is out of range \[0, 300\)"
    if "row_wise" in types.values():
        match += r".*holds rows \[\d+, \d+\) of it under row-wise sharding"
    # and how to look up raw ids instead (issue 31, item 7)
    match += r'.*hash them with RobeConfig\(bounds_check="unbounded", hash="mix"\)'
    with pytest.raises(RuntimeError, match=match):
        run_ranks(_bad_id, world, types)


def _bad_id_found_later(rank: int, world: int, types):
    from robe_torchrec.ops import cpu_backend, defer_checks
    from robe_torchrec.ops.tuning import tuned

    dmp = common.make_dmp(ROBE, types, world, optimizer=(torch.optim.SGD, {"lr": 0.1}))
    kjt = common.local_slice(common.global_batch(0, world), rank)
    values = kjt.values().clone()
    values[kjt.offset_per_key()[3]] = 10**6  # f3's table has 300 rows
    bad = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), values, kjt.lengths())
    # each answer copied on its own: the next batch's first op call reads it, whichever
    # lookup makes that call
    with cpu_backend("triton"), defer_checks(True), tuned(answers_per_copy=1):
        dmp(bad)
        dmp(kjt)


@pytest.mark.slow
def test_sharded_deferred_id_error_names_the_feature_of_its_lookup():
    """Checks deferred (a GPU's default): the error a later call raises names the bad
    feature from the lookup that took it (f3 is the table-wise lookup's feature 1), not from
    the lookup whose call found it."""
    types = {"t0": "table_wise", "t1": "data_parallel", "t2": "table_wise"}
    with pytest.raises(RuntimeError, match=r"DeferredCheckError: robe: id 1000000 at "
                                           r"position \d+ of feature 1 \('f3'\) is out of "
                                           r"range \[0, 300\)"):
        run_ranks(_bad_id_found_later, 1, types)


_ONLY_THE_TOP_PACKAGE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torchrec import EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim import apply_optimizer_in_backward
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection   # nothing else of ours

ebc = RobeEmbeddingBagCollection(
    [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])],
    RobeConfig(compression=10, block_size=4))
apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.1})
holder = torch.nn.ModuleDict({"ebc": ebc})
dmp = DistributedModelParallel(holder, device=torch.device("cpu"))
print(type(dmp.module["ebc"]).__name__)
"""


def test_importing_the_package_is_enough_for_dmp_defaults():
    """A user who imports only ``robe_torchrec`` (not ``robe_torchrec.distributed``) still
    gets the ROBE module sharded by ``DistributedModelParallel(model)``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ONLY_THE_TOP_PACKAGE], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ShardedRobeEmbeddingBagCollection"
