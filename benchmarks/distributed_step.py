"""CPU benchmark: one DLRM training step under DistributedModelParallel on 2 ranks (gloo)
against the unsharded model on 1 rank, same global batch, ROBE-Z at 1000x, DATA_PARALLEL.

Model: ``torchrec.models.dlrm.DLRM`` over a :class:`RobeEmbeddingBagCollection` of
``--tables`` tables of ``--rows`` rows, dim ``--dim`` (one feature each, ``--pooling`` ids per
bag, ids uniform), ``RobeConfig(compression=1000, block_size=32, shared=True)``, fused
Adagrad on the ROBE array (``apply_optimizer_in_backward``), SGD on the dense part.

* ``unsharded, 1 rank``: the plain model, the whole global batch in one process, with
  ``torch.set_num_threads(t)`` for t = 1 and 2 (the machine's cores).
* ``DMP, 2 ranks``: two processes (one thread each), the table DATA_PARALLEL through
  :class:`RobeEmbeddingBagCollectionSharder` (array gradient all-reduced and Adagrad applied
  inside backward), dense part under DMP's DDP, each rank half the global batch. The step time
  is rank 0's (the ranks synchronise in every step's all-reduces).

A step is forward + loss + backward + dense optimizer step. Each of ``--rounds`` rounds runs
every setup once (``--iters`` timed steps after ``--warmup``), the setups interleaved so that
load from other jobs on the machine hits them alike. Reported: P50 and P90 over all rounds'
steps and each round's P50 (nearest-rank quantiles, as TorchRec's pipeline benchmark), and
the ratios, over all rounds and round by round. The target is ``DMP 2 ranks P50 <= 1.3 x
unsharded 1 rank P50`` (against the 1-thread and the 2-thread unsharded step).

Usage::

    python -m benchmarks.distributed_step --rounds 8 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from robe_torchrec.pipelines.report import machine, machine_line, nearest_rank, write_report
from robe_torchrec.distributed.spawn import run_ranks


def _build(args):
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim import apply_optimizer_in_backward

    from robe_torchrec import RobeConfig
    from robe_torchrec.embedding_bag import RobeEmbeddingBagCollection

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                                 feature_names=[f"f{i}"]) for i in range(args.tables)]
    ebc = RobeEmbeddingBagCollection(tables, RobeConfig(compression=1000, block_size=32,
                                                        shared=True))
    apply_optimizer_in_backward(torch.optim.Adagrad, [ebc.weight], {"lr": 0.01})
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                 dense_arch_layer_sizes=[128, args.dim], over_arch_layer_sizes=[256, 128, 1])
    return model


def _batches(args, n: int, rank: int, world: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    local = n // world
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        dense = torch.randn(n, 13, generator=g)[rank * local:(rank + 1) * local]
        ids = torch.randint(0, args.rows, (args.tables, n, args.pooling), generator=g)
        ids = ids[:, rank * local:(rank + 1) * local].reshape(-1)
        lengths = torch.full((args.tables * local,), args.pooling)
        kjt = KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(args.tables)], ids,
                                                  lengths)
        labels = torch.randint(0, 2, (n,), generator=g).float()[rank * local:(rank + 1) * local]
        out.append((dense, kjt, labels))
    return out


def _time_steps(model, dense_opt, batches, args) -> List[float]:
    times = []
    for it in range(args.warmup + args.iters):
        dense, kjt, labels = batches[it % len(batches)]
        t0 = time.perf_counter()
        logits = model(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times[args.warmup:]


def _unsharded(args, threads: int) -> List[float]:
    torch.set_num_threads(threads)
    model = _build(args)
    dense_opt = torch.optim.SGD([p for n, p in model.named_parameters()
                                 if "embedding_bag_collection" not in n], lr=0.01)
    return _time_steps(model, dense_opt, _batches(args, args.batch, 0, 1), args)


def _rank(rank: int, world: int, args) -> List[float]:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from robe_torchrec.distributed import RobeEmbeddingBagCollectionSharder
    from robe_torchrec.dlrm import dense_optimizer

    model = _build(args)
    sharder = RobeEmbeddingBagCollectionSharder()
    ebc = model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, per_param_sharding={t.name: data_parallel() for t in ebc.embedding_bag_configs()},
        sharder=sharder, local_size=world, world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_opt = dense_optimizer(dmp, torch.optim.SGD, {"lr": 0.01})
    return _time_steps(dmp, dense_opt, _batches(args, args.batch, rank, world), args)


def _dmp(args, world: int) -> List[float]:
    """Rank 0's step times (the ranks synchronise in every step's all-reduces)."""
    return run_ranks(_rank, world, args, threads=1, timeout=1200.0)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=10**6)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--pooling", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4096, help="global batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5,
                        help="each round runs every setup once, interleaved")
    parser.add_argument("--out", default=None, help="folder for distributed_step.{json,md}")
    args = parser.parse_args()

    setups = {
        "unsharded, 1 rank, 1 thread": lambda: _unsharded(args, 1),
        "DMP DATA_PARALLEL, 2 ranks x 1 thread": lambda: _dmp(args, 2),
        "unsharded, 1 rank, 2 threads": lambda: _unsharded(args, 2),
    }
    dmp_name = "DMP DATA_PARALLEL, 2 ranks x 1 thread"
    # interleave the setups round by round, so that load from other jobs on the machine hits
    # all of them alike; the spread between rounds shows how much that load moves the numbers
    rows: Dict[str, List[float]] = {name: [] for name in setups}
    round_p50: Dict[str, List[float]] = {name: [] for name in setups}
    loads: List[float] = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, run in setups.items():
            times = run()
            rows[name] += times
            round_p50[name].append(1e3 * nearest_rank(times, 50))
    summary = {name: {"p50_ms": 1e3 * nearest_rank(ts, 50), "p90_ms": 1e3 * nearest_rank(ts, 90)}
               for name, ts in rows.items()}
    dmp50 = summary[dmp_name]["p50_ms"]
    ratios = {f"DMP 2 ranks / {name}": dmp50 / s["p50_ms"]
              for name, s in summary.items() if name.startswith("unsharded")}
    round_ratios = {f"DMP 2 ranks / {name}": [d / u for d, u in zip(round_p50[dmp_name], p50s)]
                    for name, p50s in round_p50.items() if name.startswith("unsharded")}
    result = {"args": vars(args), "machine": machine(), "load_average_1min_per_round": loads,
              "summary": summary, "ratios_p50": ratios, "round_p50_ms": round_p50,
              "round_ratios_p50": round_ratios,
              "target": "DMP 2 ranks P50 <= 1.3 x unsharded 1 rank P50",
              "steps_ms": {k: [1e3 * t for t in v] for k, v in rows.items()}}
    lines = ["# 2-rank DMP step vs 1-rank unsharded step (CPU, gloo)", "",
             f"`python -m benchmarks.distributed_step {' '.join(sys.argv[1:])}`", "",
             f"DLRM, {args.tables} tables x {args.rows:,} rows x dim {args.dim}, ROBE-Z 1000x "
             f"(shared array, Z=32), pooling {args.pooling}, global batch {args.batch}, fused "
             f"Adagrad; per round and setup {args.iters} timed steps after {args.warmup} "
             f"warm-up; {args.rounds} rounds, setups interleaved. Machine: {machine_line()} "
             f"(shared with other jobs: 1-min load average at the start of each round "
             f"{', '.join(f'{x:.1f}' for x in loads)}).", "",
             "| setup | P50 ms (all rounds) | P90 ms | P50 by round, ms |", "|---|---:|---:|---|"]
    lines += [f"| {n} | {s['p50_ms']:.1f} | {s['p90_ms']:.1f} | "
              f"{' / '.join(f'{x:.1f}' for x in round_p50[n])} |" for n, s in summary.items()]
    lines += ["", "| ratio (P50) | all rounds | by round | target <= 1.3 |", "|---|---:|---|---|"]
    lines += [f"| {n} | {r:.2f} | {' / '.join(f'{x:.2f}' for x in round_ratios[n])} | "
              f"{'met' if r <= 1.3 else 'missed'} |" for n, r in ratios.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_report(args.out, "distributed_step", result, text)


if __name__ == "__main__":
    main()
