"""TorchRec's DLRM with ROBE-Z embeddings, sharded by DistributedModelParallel and its planner,
trained with one of our train pipelines. Runs on any number of processes (gloo on CPU, NCCL
on GPUs).

What changes from a stock TorchRec DMP script: the embedding module, our sharder in the
sharders list, and ``robe_sharding_constraints`` for the planner (a shared ROBE array is one
table to the planner, so it may only be DATA_PARALLEL or ROW_WISE).

Run::

    torchrun --nproc-per-node 2 examples/sharded_dlrm_pipeline.py --pipeline fused_sparse_dist
    python examples/sharded_dlrm_pipeline.py       # one process
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from robe_torchrec.pipelines import make_pipeline, run_to_end
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.data.synthetic import SyntheticCriteo
from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder, robe_sharding_constraints
from robe_torchrec.distributed.process_group import (before_init_process_group,
                                                     destroy_process_group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", default="fused_sparse_dist",
                        choices=["plain", "sparse_dist", "fused_sparse_dist", "semi_sync"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512, help="per rank")
    parser.add_argument("--compression", type=float, default=1000.0)
    parser.add_argument("--cardinality-scale", type=float, default=0.01)
    args = parser.parse_args()

    if "RANK" not in os.environ:  # launched without torchrun: a 1-process group
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    before_init_process_group()  # so that destroy_process_group() can end the group's threads
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                          if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)  # every rank starts from the same weights

    data = SyntheticCriteo(batch_size=args.batch_size, cardinality_scale=args.cardinality_scale)
    tables = [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=16, num_embeddings=rows,
                                 feature_names=[key])
              for key, rows in zip(data.keys, data.cardinalities)]
    # built on the meta device: DMP materialises only what each rank holds
    embeddings = RobeEmbeddingBagCollection(tables, RobeConfig(compression=args.compression),
                                            device=torch.device("meta"))
    model = DLRMTrain(DLRM(embedding_bag_collection=embeddings, dense_in_features=data.num_dense,
                           dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 32, 1]))
    # the ROBE array's optimizer runs inside backward (what FusedSparseDist and SemiSync need)
    apply_optimizer_in_backward(torch.optim.Adagrad, embeddings.parameters(), {"lr": 0.05})

    sharders = [RobeEmbeddingBagCollectionSharder(), *get_default_sharders()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device=device.type),
        constraints=robe_sharding_constraints(model))
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=device, plan=plan, sharders=sharders)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05))
    pipeline = make_pipeline(args.pipeline, dmp, dense_optimizer, device)

    # rank r trains on stream batches r, r + world, ...: each rank its own share
    train_batches = (data.batch(step * world + rank) for step in range(args.steps))
    for step in range(1, args.steps + 1):
        loss, _logits, _labels = pipeline.progress(train_batches)  # DLRMTrain output, detached
        if rank == 0 and (step % 50 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)

    # evaluate through the pipeline too: it has taken over the sharded module's forward
    auc = BinaryAUROC().to(device)
    dmp.eval()  # the pipeline then runs forward only
    held_out = (data.batch(10**6 + i * world + rank) for i in range(8))
    with torch.no_grad():
        run_to_end(pipeline, held_out, lambda out: auc.update(out[1], out[2].long()))
    value = auc.compute().item()  # torchmetrics syncs the states of all ranks
    if rank == 0:
        print(f"{args.pipeline} on {world} rank(s): held-out AUC {value:.4f}")
    destroy_process_group()


if __name__ == "__main__":
    main()
