"""The launches Nsight Compute profiles: the forward and the fused SGD backward at the
paper's setting, one id a bag and ``--ids-per-bag`` ids a bag, Z = 32, each launch variant
of the forward once. Run under ``ncu`` (docs/benchmarks.md gives the command); on its own
it only makes the calls.

    ncu --csv --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        -k regex:"forward|backward|hash_starts|optimizer" python -m benchmarks.gpu_profile
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.gpu_speed import Lookup, Scenario, robe_arrays
    from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES
    from robe_torchrec.ops import raise_pending_checks
    from robe_torchrec.ops.meta import Optimizer
    from robe_torchrec.ops.tuning import tuned

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile")
    p.add_argument("--ids-per-bag", type=int, default=20)
    p.add_argument("--block-size", type=int, default=32)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    for per_bag, variants in ((1, [{}]), (args.ids_per_bag, [{}, {"two_pass_mean_bag": 0.0}])):
        s = Scenario("profile", 10240, 128, list(CRITEO_KAGGLE_CARDINALITIES), per_bag,
                     [args.block_size], 1000.0)
        lk = Lookup(s, device)
        weights, flat = robe_arrays(lk, args.block_size)
        values, offsets, _, meta, _, z, hash_mode, params, _ = flat
        state = torch.zeros_like(weights)
        for tuning in variants:
            with torch.no_grad(), tuned(**tuning):
                for _ in range(2):  # the first call compiles; ncu skips nothing by itself
                    torch.ops.robe.forward(weights, *flat)
                    torch.ops.robe.backward_fused_(
                        lk.grad, weights, state, state.new_empty(0), values, offsets, None,
                        meta, z, hash_mode, params, int(Optimizer.SGD),
                        [0.01, 1e-8, 0.9, 0.999, 0.0], 1)
        torch.cuda.synchronize()
        raise_pending_checks()
        print(f"profiled {per_bag} id(s) a bag, variants {variants}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
