"""Position-weighted features: TorchRec's ``FeatureProcessedEmbeddingBagCollection`` around a
``RobeEmbeddingBagCollection``, sharded by ``DistributedModelParallel(model)`` with its default
sharders, trains as the unsharded model does; TorchRec's own FP-EBC sharder refuses it with
the fix, and plans stock models as before."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.utils import Batch
from torchrec.distributed.fp_embeddingbag import (
    FeatureProcessedEmbeddingBagCollectionSharder,
    ShardedFeatureProcessedEmbeddingBagCollection,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders as torchrec_defaults
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.distributed import (
    RobeEmbeddingBagCollectionSharder,
    RobeFeatureProcessedEmbeddingBagCollectionSharder,
    ShardedRobeEmbeddingBagCollection,
    UnshardedRobeModuleError,
    get_default_sharders,
)
from robe_torchrec.distributed.unsharded import check_before_sharding
from tests.distributed import common
from tests.distributed.multiprocess import run_ranks

FEATURES = ["f0", "f1", "f2"]
ROWS = {"f0": 1000, "f1": 500, "f2": 300}
DIM = 8
LR = 0.1
#: the longest bag the batches hold is 3 ids: position weights for 4 positions
MAX_LENGTH = 4


def tables():
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS[f],
                               feature_names=[f]) for i, f in enumerate(FEATURES)]


class Model(nn.Module):
    """An FP-EBC (position weights drawn away from their initial 1.0, so that they matter)
    and every feature's pooled embedding as output, by name."""

    def __init__(self, shared: bool, robe: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        if robe:
            ebc = RobeEmbeddingBagCollection(
                tables(), RobeConfig(compression=10, block_size=4, shared=shared),
                is_weighted=True)
        else:
            ebc = EmbeddingBagCollection(tables(), is_weighted=True)
        processors = PositionWeightedModuleCollection({f: MAX_LENGTH for f in FEATURES})
        with torch.no_grad():
            for weight in processors.parameters():
                weight.uniform_(0.5, 1.5)
        self.fp = FeatureProcessedEmbeddingBagCollection(ebc, processors)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.fp(kjt).to_dict()
        return torch.cat([pooled[f] for f in FEATURES], dim=1)


def batch(step: int, world: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(3000 + step)
    n = world * common.B
    lengths = [torch.randint(0, MAX_LENGTH, (n,), generator=g) for _ in FEATURES]
    values = [torch.randint(0, ROWS[f], (int(lens.sum()),), generator=g)
              for f, lens in zip(FEATURES, lengths)]
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(values), torch.cat(lengths))


def _train(rank: int, world: int, case: str):
    shared = case == "shared"
    model = Model(shared)
    apply_optimizer_in_backward(torch.optim.Adagrad,
                                model.fp._embedding_bag_collection.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))  # the default sharders
    # TorchRec's dlrm_main: a dense optimizer for what is not fused (the position weights)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=LR))
    ref = Model(shared)
    ref_opt = torch.optim.Adagrad(ref.fp._embedding_bag_collection.parameters(), lr=LR)
    ref_dense = torch.optim.SGD(ref.fp._feature_processors.parameters(), lr=LR)
    lo, hi = rank * common.B, (rank + 1) * common.B
    worst = 0.0
    for step in range(3):
        kjt = batch(step, world)
        tgt = common.target(step, world * common.B, DIM * len(FEATURES))
        out = dmp(common.local_slice(kjt, rank))
        dense.zero_grad()
        (0.5 * ((out - tgt[lo:hi]) ** 2).sum()).backward()
        dense.step()
        ref_out = ref(kjt)
        (0.5 * ((ref_out - tgt) ** 2).sum() / world).backward()  # rank-averaged, as DMP
        ref_opt.step()
        ref_dense.step()
        ref_opt.zero_grad()
        ref_dense.zero_grad()
        worst = max(worst, (out.detach() - ref_out[lo:hi].detach()).abs().max().item())
    fp = dmp.module.fp
    inner = getattr(fp, "_embedding_bag_collection", None)
    types = {n: ps.sharding_type for n, ps in dmp.plan.plan["fp"].items()}
    state, ref_state = dmp.module.state_dict(), ref.state_dict()
    moved = max((state[n] - p).abs().max().item() for n, p in ref_state.items()
                if "position" in n)
    return {"types": (type(fp), type(inner)), "plan": types, "worst": worst,
            "position_diff": moved, "keys": sorted(state),
            "ref_keys": sorted(ref_state)}


CASES = ["shared", "per_table"]


def test_feature_processed_robe_shards_and_trains_as_unsharded():
    for results in run_ranks(common.run_cases, 2, _train, CASES):
        for case, got in results.items():
            assert got["types"] == (ShardedFeatureProcessedEmbeddingBagCollection,
                                    ShardedRobeEmbeddingBagCollection), case
            allowed = {"data_parallel"} if case == "shared" else {"data_parallel",
                                                                 "table_wise"}
            assert set(got["plan"].values()) <= allowed, (case, got["plan"])
            assert got["worst"] <= 1e-5, (case, got["worst"])
            # the position weights trained by the dense optimizer, as the reference's
            assert got["position_diff"] <= 1e-5, (case, got["position_diff"])
            # checkpoints keep the unsharded model's keys
            assert got["keys"] == got["ref_keys"], case


class TrainModel(nn.Module):
    """:class:`Model` with a loss, as TorchRec's train pipelines call a model: a ``Batch`` in,
    ``(loss, (loss, output))`` out, as ``DLRMTrain`` (a pipeline returns the second)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(shared=True)

    def forward(self, batch: Batch):
        out = self.model(batch.sparse_features)
        loss = 0.5 * ((out - batch.dense_features) ** 2).sum()
        return loss, (loss.detach(), out.detach())


def _pipelined(rank: int, world: int, name: str):
    from robe_torchrec.pipelines import make_pipeline, run_to_end

    model = TrainModel()
    apply_optimizer_in_backward(torch.optim.Adagrad,
                                model.model.fp._embedding_bag_collection.parameters(),
                                {"lr": LR})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(dmp.named_parameters())],
                            lr=LR)
    pipeline = make_pipeline(name, dmp, dense, torch.device("cpu"))
    batches = [Batch(dense_features=common.target(step, common.B, DIM * len(FEATURES)),
                     sparse_features=common.local_slice(batch(step, world), rank),
                     labels=torch.zeros(common.B)) for step in range(4)]
    losses = []
    run_to_end(pipeline, iter(batches), lambda output: losses.append(float(output[0])))
    # plain lists: a tensor sent back through the queue may outlive its rank's process
    return losses, {k: common.full_tensor(v).tolist() for k, v in dmp.state_dict().items()}


def test_sparse_dist_pipeline_trains_it_as_plain():
    # TrainPipelineSparseDist runs the sharded FP-EBC's input dist a batch ahead
    for results in run_ranks(common.run_cases, 1, _pipelined, ["plain", "sparse_dist"]):
        (plain_losses, plain_state), (losses, state) = results["plain"], results["sparse_dist"]
        assert losses == plain_losses and len(losses) == 4, (losses, plain_losses)
        assert losses[-1] < losses[0], losses
        assert state.keys() == plain_state.keys()
        for key, value in state.items():
            assert value == plain_state[key], key


def _planned(model: nn.Module, sharders) -> Dict[str, Dict[str, str]]:
    topology = Topology(world_size=2, compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology).plan(model, sharders)
    return {path: {name: (ps.sharding_type, ps.compute_kernel, tuple(ps.ranks or ()))
                   for name, ps in module_plan.items()}
            for path, module_plan in plan.plan.items()}


def test_default_sharders_replace_torchrecs_fp_sharder():
    types = [type(s) for s in get_default_sharders()]
    assert RobeFeatureProcessedEmbeddingBagCollectionSharder in types
    assert FeatureProcessedEmbeddingBagCollectionSharder not in types
    assert len(types) == len(torchrec_defaults()) + 2


def test_stock_feature_processed_model_planned_as_by_torchrec():
    model = Model(shared=True, robe=False)
    assert _planned(model, get_default_sharders()) == _planned(model, torchrec_defaults())


def test_robe_feature_processed_planned_with_robe_rules():
    for shared, allowed in ((True, {"data_parallel"}), (False, {"data_parallel",
                                                                "table_wise"})):
        plan = _planned(Model(shared), get_default_sharders())
        assert list(plan) == ["fp"], plan
        assert {st for st, _, _ in plan["fp"].values()} <= allowed, plan
        assert {kernel for _, kernel, _ in plan["fp"].values()} == {"fused"}, plan


def test_torchrecs_fp_sharder_refuses_robe_with_the_fix():
    with pytest.raises(UnshardedRobeModuleError,
                       match="cannot plan the RobeEmbeddingBagCollection.*get_default_sharders"):
        _planned(Model(shared=True), torchrec_defaults())
    sharder = FeatureProcessedEmbeddingBagCollectionSharder()
    with pytest.raises(UnshardedRobeModuleError, match="cannot shard"):
        sharder.shard(Model(shared=True).fp, {}, env=None, device=torch.device("cpu"))


def test_types_and_kernels_answer_for_the_module_last_planned():
    # a row-wise ROBE sharder still plans the collection inside an FP-EBC as unsharded
    sharder = RobeFeatureProcessedEmbeddingBagCollectionSharder(
        robe_sharder=RobeEmbeddingBagCollectionSharder(row_wise=True))
    stock = FeatureProcessedEmbeddingBagCollectionSharder()
    sharder.shardable_parameters(Model(shared=True).fp)
    assert sharder.sharding_types("cpu") == ["data_parallel"]
    assert sharder.compute_kernels("data_parallel", "cpu") == ["fused"]
    sharder.shardable_parameters(Model(shared=False).fp)
    assert sharder.sharding_types("cpu") == ["data_parallel", "table_wise"]
    stock_model = Model(shared=True, robe=False).fp
    assert sharder.shardable_parameters(stock_model).keys() == \
        stock.shardable_parameters(stock_model).keys()
    assert sharder.sharding_types("cpu") == stock.sharding_types("cpu")
    assert sharder.compute_kernels("table_wise", "cpu") == stock.compute_kernels("table_wise",
                                                                                 "cpu")


def test_a_row_wise_plan_inside_an_fp_ebc_is_refused():
    sharder = RobeFeatureProcessedEmbeddingBagCollectionSharder()
    plan = {"t0": ParameterSharding(sharding_type="row_wise", compute_kernel="fused",
                                    ranks=[0])}
    with pytest.raises(ValueError, match=r"as \{'t0': 'row_wise'\}.*row-wise there is untested"):
        sharder.shard(Model(shared=False).fp, plan, env=None, device=torch.device("cpu"))


def test_dmp_takes_a_sharders_list_whose_fp_sharder_is_ours():
    """DMP's check before sharding: the ROBE collection inside an FP-EBC is sharded by the
    wrapper's sharder, so a list with ours (and no ROBE collection sharder) is accepted, and
    one whose wrapper sharder is TorchRec's is refused up front, naming the fix."""
    model = Model(shared=True)
    check_before_sharding(model, None, [RobeFeatureProcessedEmbeddingBagCollectionSharder(),
                                        EmbeddingBagCollectionSharder()])
    check_before_sharding(model, None, get_default_sharders())
    # the last sharder of a type is the one DMP uses
    with pytest.raises(UnshardedRobeModuleError,
                       match="shards FeatureProcessedEmbeddingBagCollection 'fp' with "
                             "FeatureProcessedEmbeddingBagCollectionSharder.*in its place"):
        check_before_sharding(model, None, [RobeFeatureProcessedEmbeddingBagCollectionSharder(),
                                            *torchrec_defaults()])
