"""How much faster is ``FastInteractionArch`` than TorchRec's DLRM ``InteractionArch``?
Forward + backward of both (random upstream gradient), alternating in every round.

Usage::

    python -m benchmarks.interaction --out benchmarks/results
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torchrec.models.dlrm import InteractionArch

from benchmarks.common import command_line, header, interleaved, medians_ms, parser, publish, table
from robe_torchrec.interaction import FastInteractionArch


def measure(batch: int, features: int, dim: int, iters: int) -> Dict[str, float]:
    """Median forward + backward ms of both archs, alternating, after one warm-up call."""
    dense = torch.randn(batch, dim, requires_grad=True)
    sparse = torch.randn(batch, features, dim, requires_grad=True)
    upstream = torch.randn(batch, dim + features * (features + 1) // 2)

    def step(arch: torch.nn.Module):
        return lambda it: torch.autograd.grad(arch(dense, sparse), (dense, sparse), upstream)

    ms = medians_ms(interleaved({"torchrec": step(InteractionArch(features)),
                                 "fast": step(FastInteractionArch(features))}, iters, warmup=1))
    return {"torchrec_ms": ms["torchrec"]["wall"], "fast_ms": ms["fast"]["wall"],
            "speedup": ms["torchrec"]["wall"] / ms["fast"]["wall"]}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    p = parser("interaction", __doc__)
    p.add_argument("--shapes", nargs="+", default=["2048x26x16", "2048x26x128", "512x26x16"],
                   help="batch x sparse features x dim")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10, help="per round")
    p.add_argument("--out", default=None, help="a folder (interaction.md) or a .md file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes:
        batch, features, dim = (int(v) for v in shape.split("x"))
        rows.append({"batch": batch, "features": features, "dim": dim,
                     **measure(batch, features, dim, args.rounds * args.iters)})
    lines = header("DLRM dot interaction: TorchRec's InteractionArch vs FastInteractionArch",
                   command_line("interaction", argv),
                   f"{args.threads} thread(s); forward + backward, median of "
                   f"{args.rounds * args.iters} alternating iterations, ms")
    lines += table(["batch", "sparse features", "dim", "TorchRec", "Fast", "speedup"],
                   [[r["batch"], r["features"], r["dim"], f"{r['torchrec_ms']:.2f}",
                     f"{r['fast_ms']:.2f}", f"{r['speedup']:.2f}x"] for r in rows])
    result = {"command": command_line("interaction", argv), "args": vars(args), "rows": rows}
    publish(args.out, "interaction", lines, result)
    return result


if __name__ == "__main__":
    main()
