"""How long is a DLRM training step under DistributedModelParallel on 2 CPU ranks (gloo),
against the unsharded model on 1 rank, for the same global batch?

Model: TorchRec's ``DLRM`` over a ``RobeEmbeddingBagCollection`` of ``--tables`` tables of
``--rows`` rows, dim ``--dim`` (one feature each, ``--pooling`` ids a bag, ids uniform),
``RobeConfig(compression=1000, block_size=32, shared=True)``, fused Adagrad on the array, SGD
on the dense part. Setups: the unsharded model with the whole global batch at 1 and at 2
threads; DMP on 2 ranks of 1 thread, the array DATA_PARALLEL (its gradient all-reduced and
Adagrad applied inside backward), each rank half the batch (rank 0's step times: the ranks
synchronise in every step). A step is forward, loss, backward and the dense step. Each of
``--rounds`` rounds runs every setup once, interleaved; reported are P50 and P90 over all
steps, each round's P50 (nearest rank) and the ratios. Target: DMP 2 ranks P50 <= 1.3x the
unsharded P50.

Usage::

    python -m benchmarks.distributed_step --rounds 8 --out benchmarks/results
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from benchmarks.common import command_line, header, interleaved, loadavg, nearest_rank, publish, table
from robe_torchrec.distributed.spawn import run_ranks

DMP = "DMP DATA_PARALLEL, 2 ranks x 1 thread"
TARGET = 1.3


def _build(args):
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import apply_optimizer_in_backward

    from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=32, shared=True))
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.01})
    return DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                dense_arch_layer_sizes=[128, args.dim], over_arch_layer_sizes=[256, 128, 1])


def _batches(args, rank: int, world: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    n, local, out = args.batch, args.batch // world, []
    part = slice(rank * local, (rank + 1) * local)
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        dense = torch.randn(n, 13, generator=g)[part]
        ids = torch.randint(0, args.rows, (args.tables, n, args.pooling), generator=g)[:, part]
        kjt = KeyedJaggedTensor.from_lengths_sync([f"f{t}" for t in range(args.tables)], ids.reshape(-1),
                                                  torch.full((args.tables * local,), args.pooling))
        out.append((dense, kjt, torch.randint(0, 2, (n,), generator=g).float()[part]))
    return out


def _steps(model, dense_opt, batches, args) -> List[float]:
    def step(it: int) -> None:
        dense, kjt, labels = batches[it % len(batches)]
        logits = model(dense, kjt).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        dense_opt.step()
        dense_opt.zero_grad()

    return interleaved({"step": step}, args.iters, args.warmup)["step"]["wall"]


def _unsharded(args, threads: int) -> List[float]:
    torch.set_num_threads(threads)
    model = _build(args)
    dense_opt = torch.optim.SGD([p for n, p in model.named_parameters()
                                 if "embedding_bag_collection" not in n], lr=0.01)
    return _steps(model, dense_opt, _batches(args, 0, 1), args)


def _rank(rank: int, world: int, args) -> List[float]:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
    from robe_torchrec.dlrm import dense_optimizer

    model, sharder = _build(args), RobeEmbeddingBagCollectionSharder()
    ebc = model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding={t.name: data_parallel() for t in ebc.embedding_bag_configs()},
        sharder=sharder, local_size=world, world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    return _steps(dmp, dense_optimizer(dmp, torch.optim.SGD, {"lr": 0.01}),
                  _batches(args, rank, world), args)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed_step", description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=10**6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=4)
    p.add_argument("--batch", type=int, default=4096, help="global batch")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="each runs every setup once, interleaved")
    p.add_argument("--out", default=None, help="a folder (distributed_step.md) or a .md file")
    args = p.parse_args(argv)
    setups = {"unsharded, 1 rank, 1 thread": lambda: _unsharded(args, 1),
              DMP: lambda: run_ranks(_rank, 2, args, threads=1, timeout=1200.0)[0],
              "unsharded, 1 rank, 2 threads": lambda: _unsharded(args, 2)}
    steps: Dict[str, List[float]] = {name: [] for name in setups}
    round_p50: Dict[str, List[float]] = {name: [] for name in setups}
    loads = []
    for _ in range(args.rounds):  # load from other jobs hits every setup alike
        loads.append(loadavg())
        for name, run in setups.items():
            times = [1e3 * t for t in run()]
            steps[name] += times
            round_p50[name].append(nearest_rank(times, 50))
    summary = {n: {"p50_ms": nearest_rank(t, 50), "p90_ms": nearest_rank(t, 90)} for n, t in steps.items()}
    ratios = {f"DMP 2 ranks / {n}": summary[DMP]["p50_ms"] / s["p50_ms"]
              for n, s in summary.items() if n != DMP}
    round_ratios = {f"DMP 2 ranks / {n}": [d / u for d, u in zip(round_p50[DMP], p50s)]
                    for n, p50s in round_p50.items() if n != DMP}
    lines = header("2-rank DMP step vs 1-rank unsharded step (CPU, gloo)",
                   command_line("distributed_step", argv),
                   f"setup: DLRM, {args.tables} tables x {args.rows:,} rows x dim {args.dim}, ROBE-Z "
                   f"1000x (shared array, Z=32), pooling {args.pooling}, global batch {args.batch}, "
                   f"fused Adagrad; {args.iters} timed steps after {args.warmup} a round and setup, "
                   f"{args.rounds} rounds interleaved; 1-min load at each round's start "
                   + ", ".join(f"{x:.1f}" for x in loads))
    lines += table(["setup", "P50 ms (all rounds)", "P90 ms", "P50 by round, ms"],
                   [[n, f"{s['p50_ms']:.1f}", f"{s['p90_ms']:.1f}",
                     " / ".join(f"{x:.1f}" for x in round_p50[n])] for n, s in summary.items()]) + [""]
    lines += table(["ratio (P50)", "all rounds", "by round", f"target <= {TARGET}"],
                   [[n, f"{r:.2f}", " / ".join(f"{x:.2f}" for x in round_ratios[n]),
                     "met" if r <= TARGET else "missed"] for n, r in ratios.items()])
    result = {"command": command_line("distributed_step", argv), "args": vars(args),
              "load_average_1min_per_round": loads, "summary": summary, "ratios_p50": ratios,
              "round_p50_ms": round_p50, "round_ratios_p50": round_ratios, "steps_ms": steps,
              "target": f"DMP 2 ranks P50 <= {TARGET} x unsharded 1 rank P50"}
    publish(args.out, "distributed_step", lines, result)
    return result


if __name__ == "__main__":
    main()
