"""DistributedModelParallel around torchrec.models.dlrm.DLRM with ROBE-Z embeddings, planned
by EmbeddingShardingPlanner: the 2-rank model trains step for step as the unsharded one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec import RobeConfig
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder, robe_sharding_constraints
from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection
from tests.distributed import common

from tests.distributed.multiprocess import run_ranks

DIM, B, STEPS = 8, 4, 6
FEATURES = ["f0", "f1", "f2"]
ROWS = {"f0": 10**6, "f1": 5000, "f2": 300}


def _model(shared: bool) -> DLRM:
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS[f],
                                 feature_names=[f]) for i, f in enumerate(FEATURES)]
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=4,
                                                        shared=shared))
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.05})
    return DLRM(embedding_bag_collection=ebc, dense_in_features=5,
                dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])


def _batch(step: int, n: int):
    g = torch.Generator().manual_seed(77 + step)
    lengths = torch.randint(0, 4, (len(FEATURES) * n,), generator=g)
    values = torch.cat([torch.randint(0, ROWS[f], (int(lengths[i * n:(i + 1) * n].sum()),),
                                      generator=g) for i, f in enumerate(FEATURES)])
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)
    return torch.randn(n, 5, generator=g), kjt, torch.randint(0, 2, (n,), generator=g).float()


def _run(rank: int, world: int, shared: bool):
    sharder = RobeEmbeddingBagCollectionSharder()
    model = _model(shared)
    constraints = {"t0": ParameterConstraints(sharding_types=["table_wise"]),
                   "t1": ParameterConstraints(sharding_types=["table_wise"]),
                   "t2": ParameterConstraints(sharding_types=["data_parallel"])}
    if shared:
        constraints = robe_sharding_constraints(model)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    types = {n: ps.sharding_type for n, ps in plan.get_plan_for_module(
        "sparse_arch.embedding_bag_collection").items()}
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=0.1))
    assert "sparse_arch.embedding_bag_collection.weight" in dmp.fused_optimizer.params
    ref = _model(shared)
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters()
                               if "embedding_bag_collection" not in n], lr=0.1)
    worst = 0.0
    for step in range(STEPS):
        dense, kjt, labels = _batch(step, world * B)
        lo, hi = rank * B, (rank + 1) * B
        logits = dmp(dense[lo:hi], common.local_slice(kjt, rank, B)).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[lo:hi]).backward()
        dense_opt.step()
        dense_opt.zero_grad()
        ref_logits = ref(dense, kjt).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(ref_logits, labels).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, (logits.detach() - ref_logits[lo:hi].detach()).abs().max().item())
    w = common.full_tensor(dmp.state_dict()["sparse_arch.embedding_bag_collection.weight"])
    w_diff = (w - ref.sparse_arch.embedding_bag_collection.weight.detach()).abs().max().item()
    return types, worst, w_diff


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True])
def test_dlrm_dmp_matches_unsharded(shared):
    for types, worst, w_diff in run_ranks(_run, 2, shared):
        if shared:
            assert set(types.values()) == {"data_parallel"}
        else:
            assert types == {"t0": "table_wise", "t1": "table_wise", "t2": "data_parallel"}
        assert worst <= 1e-5 and w_diff <= 1e-5, (worst, w_diff)


def _run_pipeline(rank: int, world: int):
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.models.dlrm import DLRMTrain

    sharder = RobeEmbeddingBagCollectionSharder()
    model = DLRMTrain(_model(False))
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(3)}
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                    constraints=constraints).collective_plan(
        model, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=0.1))
    pipeline = TrainPipelineSparseDist(dmp, dense_opt, torch.device("cpu"))
    batches = []
    for step in range(STEPS):
        dense, kjt, labels = _batch(step, world * B)
        lo, hi = rank * B, (rank + 1) * B
        batches.append(Batch(dense_features=dense[lo:hi],
                             sparse_features=common.local_slice(kjt, rank, B),
                             labels=labels[lo:hi]))
    it = iter(batches)
    logits = []
    for _ in range(STEPS):
        _l, step_logits, _labels = pipeline.progress(it)  # DLRMTrain output
        logits.append(step_logits.detach())
    ref = DLRMTrain(_model(False))
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters()
                               if "embedding_bag_collection" not in n], lr=0.1)
    worst = 0.0
    for step in range(STEPS):
        dense, kjt, labels = _batch(step, world * B)
        loss, (_l, ref_logits, _labels) = ref(Batch(dense_features=dense, sparse_features=kjt,
                                                     labels=labels))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lo, hi = rank * B, (rank + 1) * B
        worst = max(worst, (logits[step] - ref_logits[lo:hi].detach()).abs().max().item())
    return worst


@pytest.mark.slow
def test_train_pipeline_sparse_dist():
    # TorchRec's pipeline (input dist of the next batch overlapped) trains as the unsharded model
    for worst in run_ranks(_run_pipeline, 2):
        assert worst <= 1e-5, worst
