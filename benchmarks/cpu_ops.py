"""CPU benchmark of one training step: full table, FBGEMM TBE, pure-PyTorch ROBE-Z, our C++ ops.

The setup of the seed benchmarks (seeds 000/001): batch 32768, a *pair model* (two lookups of
one id per sample into one table / ROBE array, SUM pooling, dim 64; every row does them as one
call over 2B bags, so all rows compute the same loss on the same [2B, D] layout), ids uniform in
``[0, 1_562_500)``, loss ``sum(e1 * e2)`` over the two pooled embeddings. Rows, for each of
SGD, Adagrad and Adam:

* ``full table``: ``nn.EmbeddingBag(1_562_500, 64)`` (100M floats, 381.5 MB), sparse gradients
  (``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam``) and dense gradients (``SGD`` / ``Adagrad``
  / ``Adam``);
* ``fbgemm TBE``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU (``HOST`` / ``CPU``)
  with its fused optimizer (whatever FBGEMM supports on CPU; the others are ``n/a`` with
  FBGEMM's own error message);
* ``pytorch ROBE-Z``: :mod:`robe_torchrec.ops.reference` (the vectorised pure-PyTorch ROBE-Z),
  dense gradient + ``torch.optim``, arrays of 262,144 and 2,621,440 floats, Z = 32;
* ``ours``: the C++ ops (``cpu_backend("cpp")``), dense gradient + ``torch.optim`` and fused
  (the package's :func:`robe_torchrec.fused_lookup.fused_lookup`, whose
  ``robe::backward_fused_`` applies the optimizer inside backward), same arrays, Z = 32, plus
  Z = 8 rows at 2,621,440 floats;
* ``floor``: the step floor of each array size: the same loss and ``torch.optim`` optimizer
  around an embedding whose forward only writes its output from a cache-resident source
  (the forward floor) and whose backward only reads its gradient once.

Every row runs with each loss of ``--losses``: ``sum(e1*e2)`` (the seed benchmarks') and
``sum(outputs)`` (whose backward is little more than the embedding's own). Each row reports
its forward and total over the floor's; a separate section times our forward alone against
the forward floor for both hashes, Z = 8 and 32 and both arrays, interleaved; another sets
our backward against one read of its gradient. The targets against the floors (forward <=
1.5x its floor at 1 thread, 2 threads <= 0.6x our 1-thread forward, step <= 1.5x the step
floor with ``sum(outputs)``) are reported met or missed with margins; the 2-thread target
beside the machine's own 2-thread scaling (a compute-bound matmul, same loop).

The forward section also profiles each case at 1 thread, in the same interleaved loop: the
C++ kernel's hashing alone (``cpu.forward_hash_only``), its hashing + gathers without the
output stores (``cpu.forward_gather_only``), a read of every cache line its gathers touch
(:func:`read_lines`), its dense-gradient backward and one read of that gradient. From them
the report splits the forward into hash / gather / store, sets it against the floor of the
algorithm (store + hash + lines) and says what stands between the kernel and the floor.

Columns (milliseconds, median over ``--iters`` iterations after ``--warmup``):

* ``forward``: the embedding call alone (one call covers both features);
* ``hashing`` / ``lookup`` / ``other``: the split of the forward. Pure-PyTorch ROBE-Z: timed
  exactly, hashing = ``reference.element_indices`` of both features, lookup = the reference's
  gather + pool with those indices, other = forward - hashing - lookup (input validation,
  slicing). Ours with the C++ kernel: hashing = ``cpu.forward_hash_only`` (the kernel's own
  hash pass, without prefetches, gathers and output writes), lookup = forward - hashing
  (marked ``~``). Ours with another backend (testing only; marked ``~``): lookup = the same
  pooled lookup from precomputed block starts (``F.embedding`` over a stride-1 ``as_strided``
  view of the array, which copies whole Z-float blocks: exact for one id per bag), hashing =
  forward - lookup (clipped at 0);
* ``backward``: loss + ``loss.backward()`` (gradient computation; includes the update for fused
  rows);
* ``optimizer``: ``optimizer.step()`` + ``zero_grad(set_to_none=True)`` (0 when fused);
* ``total``: the median of the per-iteration sum forward + backward + optimizer;
* ``model MB``: the learned weights (optimizer state not counted).

Every row uses the same pre-generated batches. The rows of one loss and optimizer whose
arrays hold at most 10M floats (floors, pytorch ROBE-Z, ours) are built together and timed
interleaved, one train step of each in turn (in alternating order), so the load of other
processes hits a row and its floor alike; full tables (hundreds of MB each) run alone. All
thread counts run in one process, so every ratio in the "targets" sections comes from one run.

The code, by question: :mod:`benchmarks.cpu_ops_step` (the rows: one training step of each
implementation, its timing loop, tables and targets), :mod:`benchmarks.cpu_ops_forward` (our
forward against its floors, its profile, the step floors), :mod:`benchmarks.cpu_ops_common`
(what both use: sizes, batches, the runner interface, the floors, the machine); this module
runs them and writes the report.

Run::

    python -m benchmarks.cpu_ops                      # threads 1 and 2
    python -m benchmarks.cpu_ops --quick              # tiny sizes (smoke test)
    python -m benchmarks.cpu_ops --out benchmarks/results/cpu_ops.md
    python -m benchmarks.cpu_ops --rows floor ours    # only what the floor targets need
"""


from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.cpu_ops_common import (
    FLOOR_SOURCE_ROWS, FULL_SIZES, HASH_SEED, INTERLEAVE_MAX_FLOATS, LOSSES, LOSS_TEXT, LR,
    OPTIMIZERS, QUICK_SIZES, contention_warning, keep_freed_memory, loadavg, machine_lines,
    make_batches)
from benchmarks.cpu_ops_step import Result, results_tables, row_specs, run_specs, targets_section
from benchmarks.cpu_ops_forward import (
    ForwardProfile, backward_profile_section, backward_read_section, floor_targets_section,
    forward_floor_section, forward_profile_section, forward_profiles, machine_scaling_summary,
    stands_between_section, step_floors, step_floors_section, time_forwards)
# what the tests and other benchmarks reach through this module
from benchmarks.cpu_ops_common import (  # noqa: F401
    COMPUTE_REFERENCE, Floor, Runner, Unavailable, _FloorLookup, floor_forward)
from benchmarks.cpu_ops_forward import (  # noqa: F401
    ForwardCase, StepFloors, expected_lines, forward_cases)
from benchmarks.cpu_ops_step import Robe, RowSpec  # noqa: F401
from robe_torchrec.hashing import HashMode

# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_ops",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch.set_num_threads values (default: 1 2; --quick: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warmup iterations (default 3; quick 1)")
    p.add_argument("--forward-iters", type=int, default=None,
                   help="timed iterations of the forward-floor section (default 3 x --iters)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, a few seconds)")
    p.add_argument("--hash", default="reference", choices=["reference", "mix"],
                   help="ROBE hash for the ROBE rows (default: the paper's)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--rows", nargs="+", default=["floor", "full", "fbgemm", "pytorch", "ours"],
                   choices=["floor", "full", "fbgemm", "pytorch", "ours"],
                   help="row groups to run (the forward-floor section runs with 'ours')")
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES,
                   help="pair: sum(e1*e2); sum: sum(outputs) (default: both)")
    p.add_argument("--ours-backend", default="cpp", choices=["cpp", "triton", "reference"],
                   help="implementation behind the 'ours' rows (default cpp; others for testing)")
    p.add_argument("--out", default=None, help="also write a markdown report to this file (and its numbers to the .json beside it)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> str:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    threads = args.threads or ([1] if args.quick else [1, 2])
    iters = args.iters if args.iters is not None else (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    hash_mode = HashMode.parse(args.hash)
    allocator = keep_freed_memory()
    torch.manual_seed(0)
    start = datetime.datetime.now(datetime.timezone.utc)
    load_start = loadavg()
    batches = make_batches(sizes, count=max(1, min(warmup + iters, 8)))

    fwd: Dict[Tuple[int, str], float] = {}
    profiles: List[ForwardProfile] = []  # at 1 thread
    profiles_by_threads: Dict[int, List[ForwardProfile]] = {}
    if "ours" in args.rows:
        t0 = time.perf_counter()
        fwd = time_forwards(sizes, threads, batches, warmup, args.forward_iters or 3 * iters,
                            args.ours_backend)
        profiles_by_threads = {k: forward_profiles(fwd, sizes, k) for k in threads}
        profiles = profiles_by_threads.get(1, [])
        print(f"[{time.perf_counter() - t0:6.1f}s] forward floor section", file=sys.stderr, flush=True)
    results: List[Result] = []
    for opt, loss in [(o, x) for x in args.losses for o in args.optimizers]:
        specs = [dataclasses.replace(spec, loss=loss)
                 for spec in row_specs(sizes, opt, args.rows, hash_mode, args.ours_backend)]
        # rows of ROBE-sized arrays run interleaved; full tables (hundreds of MB each) alone
        small = [spec for spec in specs if spec.floats <= INTERLEAVE_MAX_FLOATS]
        groups = [small] + [[spec] for spec in specs if spec.floats > INTERLEAVE_MAX_FLOATS]
        for group in filter(None, groups):
            t0 = time.perf_counter()
            rs = run_specs(group, threads, batches, sizes, warmup, iters)
            results.extend(rs)
            for r in rs:
                status = r.unavailable or f"total {r.phases.get('total', float('nan')):.1f} ms"
                print(f"[{time.perf_counter() - t0:6.1f}s] {r.spec.key} {opt} {loss} "
                      f"{r.threads}t: {status}", file=sys.stderr, flush=True)
    # the tables list rows in row_specs' order within each (loss, optimizer)
    order = {(loss, opt): i for i, (opt, loss) in enumerate(
        [(o, x) for x in args.losses for o in args.optimizers])}
    results.sort(key=lambda r: order[(r.spec.loss, r.spec.optimizer)])

    load_end = loadavg()
    command = "python -m benchmarks.cpu_ops " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    setup = (f"batch {sizes.batch}, pair model (two lookups of one id per sample into one table or array, done as one call over 2B bags for every row, SUM), "
             f"dim {sizes.dim}, ids uniform in [0, {sizes.num_embeddings:,}), losses "
             f"{', '.join(LOSS_TEXT[x] for x in args.losses)}, "
             f"lr {LR}; ROBE hash {hash_mode.name.lower()} (seed {HASH_SEED}); "
             f"{warmup} warmup + {iters} timed iterations, medians, {len(batches)} distinct batches")
    report = "\n".join([
        "# CPU op benchmark: one training step of the pair model",
        "",
        f"- date: {start.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command}`",
        *machine_lines(),
        f"- load average (1/5/15 min) at start: {load_start}, at end: {load_end}",
        *contention_warning(load_start),
        f"- allocator: {allocator}",
        f"- setup: {setup}",
        "",
        "Columns in ms. forward = the embedding call; hashing/lookup/other = its split "
        "(pytorch ROBE-Z: hashing and gather + pool timed apart, other = the rest; ours: "
        "hashing = the C++ kernel's forward_hash_only (its hash pass: loops, id checks, hashes "
        "and tile buffers, without prefetches, gathers and output writes), `~` lookup = "
        "forward - hashing); backward = loss + autograd backward "
        "(includes the update for fused rows); optimizer step = step + zero_grad; "
        "total = forward + backward + optimizer step (median of per-iteration sums); CPU "
        "total = the calling thread's CPU time for the step (at 1 thread all of its work, and "
        "not inflated by time spent descheduled: on a busy machine wall time inflates a call "
        "longer than a scheduler slice more than a short one, which biases wall-time ratios "
        "against the slower row; at 2 threads it misses the worker thread's share). "
        "forward / floor and total / floor: the row's forward over the forward floor's, its "
        "total over the step floor's (the `floor` row of the same loss, optimizer, threads and "
        "array; rows of another size: the smallest array's floor).",
        "",
        "## Forward against its floor",
        "",
        "The forward floor writes a fresh [2B, D] float output from a cache-resident "
        f"[{FLOOR_SOURCE_ROWS}, D] source (`floor_forward`). Our forward (C++ kernel, dense, "
        "no autograd) in each case; every iteration runs the floor and all cases at every "
        "thread count back to back, medians in ms.",
        "",
        forward_floor_section(fwd, threads, sizes) if fwd else "(not run: needs the 'ours' rows)",
        "",
        f"Bytes per forward: the output is {2 * sizes.batch * sizes.dim * 4 / 2**20:.1f} MiB, "
        "written once (the floor's whole work); the gathers read "
        f"{2 * sizes.batch * sizes.dim * 4 / 2**20:.1f} MiB of weights in "
        f"{2 * sizes.batch:,} x dim/Z random blocks of Z floats (each block spans 1-3 cache "
        "lines, anywhere in the array). hashing = `forward_hash_only` (the kernel's hash pass: "
        "loops, id checks, hashes and tile buffers, without prefetches, gathers and output "
        "writes); the rest of CPU ms is the gathers, "
        "the pooling and the stores.",
        "",
        "## Where the forward's time goes (profile, 1 thread)",
        "",
        "CPU ms at 1 thread, medians, timed in the loop of the section above (each iteration "
        "runs every entry back to back, so the array is as cold for each as for the forward). "
        "store floor = the forward floor; hash only = `forward_hash_only`; hash + gather = "
        "`forward_gather_only` (the forward without its output stores: hashes, gathers and "
        "pools every row, then adds it to a cache-resident sum). hash = hash only; gather = "
        "hash + gather - hash only; store = forward - (hash + gather) (shares of the forward in "
        "brackets); overlap = store floor + (hash + gather) - forward: how much of the store "
        "floor's time the forward hides (negative: its stores cost more than the floor's).",
        "",
        forward_profile_section(profiles) if profiles else "(not run: needs the C++ kernel)",
        "",
        "### What stands between the kernel and the floor",
        "",
        stands_between_section(profiles),
        "",
        "## Backward profile (1 thread)",
        "",
        "CPU ms at 1 thread, same loop: the dense-gradient op (`robe::backward_dense`, no "
        "autograd, no loss) for a fixed [2B, D] output gradient, one read of that gradient "
        "(`sum`), and the forward's hashing alone (the backward hashes the same (id, block) "
        "pairs). rest = backward - hash only - read once: zeroing the array's gradient and "
        "scattering into it; line reads = the forward's (the scatter reads and writes the "
        "same lines).",
        "",
        backward_profile_section(fwd, sizes),
        "",
        "## Step rows",
        "",
        results_tables(results, threads, sizes),
        "",
        "## Backward against one read of its gradient",
        "",
        "own backward = our backward - the floor's backward (same loss, optimizer, threads, "
        "array: it holds the loss's own backward and one read of the gradient) + read once "
        "(one `sum` over a materialised [2B, D] float gradient, timed in the floor row).",
        "",
        backward_read_section(results, sizes),
        "",
        "## Targets against the floors (same run)",
        "",
        floor_targets_section(fwd, results, threads, sizes),
        "",
        *([scaling, ""] if (scaling := machine_scaling_summary(fwd, threads, sizes)) else []),
        "### What stands between the step and its floor",
        "",
        "ms: CPU time at 1 thread, wall time at 2 (as the targets). serial floor = the step "
        "floor + hash only + 2 x line reads (the profile's, same array, Z and hash, timed at "
        "the row's threads in the forward section's loop): the hashing, the gathers' line "
        "reads and the scatter's read-modify-write of the same lines, none of which the step "
        "floor does. overlapped floor = the step floor with the forward at the largest of its "
        "store floor, hashing and line reads, and the scatter's lines hidden under the "
        "gradient's one read. At 2 threads these parts are timed on 2 threads, so the floor "
        "takes whatever the two cores and their shared memory give them.",
        "",
        step_floors_section(step_floors(profiles_by_threads, fwd, results, sizes, hash_mode)),
        "",
        *([] if not {"full", "pytorch"} & set(args.rows) else [
            "## Targets against the other rows (same run, loss sum(e1*e2))",
            "",
            targets_section(results, threads, sizes),
            "",
        ]),
    ])
    print(report, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        data = json_report(command, start, (load_start, load_end), fwd, profiles, results)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.out} and its .json", file=sys.stderr)
    return report


def json_report(command: str, start: datetime.datetime, load: Tuple[str, str],
                fwd: Dict[Tuple[int, str], float], profiles: Sequence[ForwardProfile],
                results: Sequence[Result]) -> Dict[str, object]:
    """The report's numbers (ms) for scripts: the forward section's medians keyed
    "<threads>t <name>" (``cpu ...``: CPU time), the profile per case, and every step row."""
    return {
        "command": command, "date": start.isoformat(), "load_average": {"start": load[0], "end": load[1]},
        "machine": machine_lines(),
        "forward": {f"{k}t {name}": ms for (k, name), ms in fwd.items()},
        "profile": [dict(case=p.case.name, **{f.name: getattr(p, f.name) for f in
                                              dataclasses.fields(p) if f.name != "case"})
                    for p in profiles],
        "rows": [dict(key=r.spec.key, model=r.spec.model, loss=r.spec.loss, optimizer=r.spec.optimizer,
                      gradient=r.spec.gradient, floats=r.spec.floats, block_size=r.spec.block_size,
                      threads=r.threads, phases=r.phases, split=r.split, notes=r.notes,
                      unavailable=r.unavailable) for r in results],
    }


if __name__ == "__main__":
    main()
