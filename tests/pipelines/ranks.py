"""Rank functions of the pipeline tests (run by ``tests.distributed.multiprocess.run_ranks``)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from robe_torchrec.pipelines import make_pipeline, run_to_end
from robe_torchrec.pipelines.model import build_sharded_dlrm, gather_state
from robe_torchrec import RobeConfig
from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.dlrm import DLRMSpec, OptimizerSpec

B = 16          # local batch
STEPS = 8       # batches per run
DISTINCT = 4    # distinct batches, cycled, so that the loss visibly falls in 8 steps
CPU = torch.device("cpu")
#: the tests' small DLRM: ROBE-Z, one array per table, fused Adagrad, dense SGD
SMALL = DLRMSpec(robe=RobeConfig(compression=1000.0, block_size=8, shared=False),
                 embedding_dim=8, dense_arch=(16, 8), over_arch=(16, 1),
                 embedding_optimizer=OptimizerSpec("adagrad", lr=0.05),
                 dense_optimizer=OptimizerSpec("sgd", lr=0.1))


def dense_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD (lr 0.1) over the parameters no optimizer in backward updates."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return torch.optim.SGD([p for _, p in in_backward_optimizer_filter(model.named_parameters())],
                           lr=0.1)


class GuardModel(torch.nn.Module):
    """The guard tests' model: an embedding module (``sparse``) and a dense layer."""

    def __init__(self, sparse: torch.nn.Module) -> None:
        super().__init__()
        self.sparse = sparse
        self.dense = torch.nn.Linear(4, 1)


def data() -> SyntheticCriteo:
    return SyntheticCriteo(batch_size=B, cardinality_scale=1e-3, seed=dist.get_rank(),
                           num_sparse=4)


def train(spec: DLRMSpec, sharding: str, name: str, options: Dict
          ) -> Tuple[Dict[str, torch.Tensor], List[float], int]:
    """Train a fresh model for STEPS batches with pipeline ``name``: the full state, the
    per-step losses and the number of progress() calls that returned."""
    d = data()
    dmp, dense = build_sharded_dlrm(spec, d, sharding)
    pipeline = make_pipeline(name, dmp, dense, CPU, **options)
    it = iter([d.batch(i % DISTINCT) for i in range(STEPS)])
    losses: List[float] = []
    run_to_end(pipeline, it, lambda out: losses.append(float(out[0].detach())))  # DLRMTrain
    return gather_state(dmp), losses, len(losses)


def run_variants(rank: int, world: int, spec: DLRMSpec, sharding: str,
                 variants: List[Tuple[str, str, Dict]]):
    """``{label: (state as numpy arrays, losses, steps)}`` for each ``(label, pipeline name,
    options)`` (pipeline name ``None``: the untrained model); numpy, because tensors sent
    between processes live in shared memory that dies with the rank."""
    out = {}
    for label, name, options in variants:
        if name is None:  # the weights before training
            dmp, _ = build_sharded_dlrm(spec, data(), sharding)
            state, losses, steps = gather_state(dmp), [], 0
        else:
            state, losses, steps = train(spec, sharding, name, options)
        out[label] = ({k: v.numpy() for k, v in state.items()}, losses, steps)
    return out


def _dp_dense_trained_model():
    """A stock EBC whose tables are DATA_PARALLEL and trained by the dense optimizer (no
    in-backward optimizer): the model the guards must refuse."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from robe_torchrec.pipelines.model import EBC_FQN
    from robe_torchrec.data.synthetic import NUM_DENSE

    d = data()
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=n,
                                 feature_names=[k]) for k, n in zip(d.keys, d.cardinalities)]
    ebc = EmbeddingBagCollection(tables, device=CPU)
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                           dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1]))
    sharder = EmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding={t.name: data_parallel() for t in tables}, sharder=sharder,
        local_size=dist.get_world_size(), world_size=dist.get_world_size(), device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=CPU, plan=ShardingPlan({EBC_FQN: plan}),
                                   sharders=[sharder])
    dense = torch.optim.SGD(dmp.parameters(), lr=0.1)
    return dmp, dense, d


def guards_on_dp_dense_tables(rank: int, world: int):
    """What each pipeline says about a model with data-parallel tables trained by the dense
    optimizer; and what FusedSparseDist/SemiSync would do to it without the guard
    ("identical" to SparseDist, "differs", or "fails: <error>")."""
    from robe_torchrec.pipelines import PipelineModelError
    import robe_torchrec.pipelines.fused_sparse_dist as fsd_mod
    import robe_torchrec.pipelines.semi_sync as ss_mod

    verdicts = {}
    for name in ("plain", "sparse_dist", "fused_sparse_dist", "semi_sync"):
        dmp, dense, _ = _dp_dense_trained_model()
        try:
            make_pipeline(name, dmp, dense, CPU)
            verdicts[name] = "accepted"
        except PipelineModelError as e:
            verdicts[name] = str(e)

    def run(name, options):
        dmp, dense, d = _dp_dense_trained_model()
        pipeline = make_pipeline(name, dmp, dense, CPU, **options)
        run_to_end(pipeline, iter([d.batch(i) for i in range(4)]))
        return gather_state(dmp)

    reference = run("sparse_dist", {})
    unguarded = {}
    saved = fsd_mod.check_pipeline_model, ss_mod.check_pipeline_model
    fsd_mod.check_pipeline_model = ss_mod.check_pipeline_model = lambda *a, **k: None
    try:
        for label, name, options in [("fused_sparse_dist", "fused_sparse_dist", {}),
                                     ("semi_sync", "semi_sync", {"start_batch": 0,
                                                                 "strict": False})]:
            try:
                state = run(name, options)
            except RuntimeError as e:  # e.g. autograd: a weight modified in place
                unguarded[label] = f"fails: {e}"
                continue
            same = all(torch.equal(state[k], reference[k]) for k in reference)
            unguarded[label] = "identical" if same else "differs"
    finally:
        fsd_mod.check_pipeline_model, ss_mod.check_pipeline_model = saved
    return verdicts, unguarded


def torchrec_originals_on_cpu(rank: int, world: int) -> Dict[str, str]:
    """TorchRec's own FusedSparseDist and SemiSync on a CPU DMP model: the error each
    raises within three steps ("ok" if none), the reason this package overrides them."""
    from torchrec.distributed.train_pipeline.train_pipelines import (
        TrainPipelineFusedSparseDist,
        TrainPipelineSemiSync,
    )

    out = {}
    for cls, kwargs in [(TrainPipelineFusedSparseDist, {}),
                        (TrainPipelineSemiSync, {"start_batch": 0})]:
        d = data()
        dmp, dense = build_sharded_dlrm(SMALL, d, "table_wise")
        pipeline = cls(dmp, dense, CPU, **kwargs)
        it = iter([d.batch(i) for i in range(3)])
        try:
            for _ in range(3):
                pipeline.progress(it)
            out[cls.__name__] = "ok"
        except Exception as e:  # noqa: BLE001 - the error is the result
            out[cls.__name__] = f"{type(e).__name__}: {e}"
    return out


def guards_on_sharded_fp_ebc(rank: int, world: int) -> Dict[str, str]:
    """What each pipeline says about a DMP-sharded FeatureProcessedEmbeddingBagCollection
    (position weights) whose tables are trained by a fused optimizer; also the sharded
    module's type name, which the guard recognises."""
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.optim import apply_optimizer_in_backward
    from robe_torchrec.pipelines import PipelineModelError

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=100,
                                 feature_names=["f0"])]
    ebc = EmbeddingBagCollection(tables, is_weighted=True, device=torch.device("meta"))
    fp_ebc = FeatureProcessedEmbeddingBagCollection(
        ebc, PositionWeightedModuleCollection({"f0": 4}))
    apply_optimizer_in_backward(torch.optim.SGD, list(ebc.parameters()), {"lr": 0.1})
    dmp = DistributedModelParallel(GuardModel(fp_ebc), env=ShardingEnv.from_process_group(
        dist.group.WORLD), device=CPU, sharders=get_default_sharders())
    dense = dense_sgd(dmp)
    verdicts = {"sharded type": type(dmp.module.sparse).__name__}
    for name in ("plain", "sparse_dist", "fused_sparse_dist", "semi_sync"):
        try:
            make_pipeline(name, dmp, dense, CPU)
            verdicts[name] = "accepted"
        except PipelineModelError as e:
            verdicts[name] = str(e)
    return verdicts
