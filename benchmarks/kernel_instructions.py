"""How many instructions does a bag kernel issue a bag, compiled for an H100? No GPU needed.

At one id a bag (the paper's setting) the forward kernel is bound by its instructions on an
H100: Nsight Compute has it 76% SM busy at a quarter of the L2's throughput
(``benchmarks/results/ncu_h100.md``). This compiles the bag kernels the ops launch at that
setting for sm_90 (Triton's compiler and ``ptxas``, through the stand-in driver of
:mod:`robe_torchrec.testing.recorded_launches`), disassembles them with the ``cuobjdump``
Triton ships, and counts their SASS instructions, launch variant by launch variant
(:mod:`robe_torchrec.ops.tuning`).

What a row says: a program's instructions (``NOP`` padding left out) times its warps,
divided by the bags it pools, is what the GPU issues a bag. With one id a bag the id loop
runs once, so a program's static count is close to what it executes; branches it skips
(the slow path of an integer division, the checks' atomics when nothing is wrong) still
count, the same in every row. A proxy for time only where the kernel is bound by issuing
instructions, as this one is; the GPU rows of ``benchmarks.gpu_check`` time the same
variants::

    python -m benchmarks.kernel_instructions --out benchmarks/results
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Dict, List, Optional, Sequence

import torch

from benchmarks.common import command_line, header, parser, publish, table
from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES
from robe_torchrec.hashing import HashMode
from robe_torchrec.ops.meta import Pooling
from robe_torchrec.testing.op_cases import random_case

#: launch variants: label -> (tuning, hash)
VARIANTS: Dict[str, dict] = {
    "default": {},
    "default, 8 bags a program": {"bags_per_program": 8},
    "compact hash": {"compact_hash": True},
    "compact hash, 4 bags a program": {"compact_hash": True, "bags_per_program": 4},
    "compact hash, 8 bags a program": {"compact_hash": True, "bags_per_program": 8},
    "compact hash, 8 bags a program, 2 warps": {"compact_hash": True, "bags_per_program": 8,
                                                "num_warps": 2},
}
#: the launch beside them on the mix hash (its output differs: another hash)
MIX = "default, mix hash"
#: the paper's setting, but a batch that only has to specialise as 10240 does (a multiple
#: of 16): the counts do not depend on how many programs run
FEATURES, DIM, BATCH = len(CRITEO_KAGGLE_CARDINALITIES), 128, 64
#: the kernels counted: those that pool (or scatter) bags
_BAG_KERNELS = ("_forward_kernel", "_forward_short_bags_kernel", "_backward_kernel",
                "_backward_short_bags_kernel")
_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def toolchain() -> str:
    """The compiler the counts come from: Triton's version and its bundled ``ptxas``'s.
    Both change the code: the GPU image's Triton 3.6 and this machine's 3.9 count the same
    kernel differently."""
    import triton

    ptxas = subprocess.run([_tool("ptxas"), "--version"], capture_output=True, text=True,
                           check=True).stdout.strip().splitlines()[-2]
    return f"Triton {triton.__version__}, ptxas {ptxas.rsplit(' ', 1)[-1]}"


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """What Triton's ``cuobjdump`` prints for ``cubin`` with ``flag``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True,
                              text=True, check=True).stdout


def sass_counts(cubin: bytes) -> collections.Counter:
    """Opcode -> how many times it appears in ``cubin``'s SASS (``NOP`` padding left out)."""
    lines = _cuobjdump(cubin, "-sass").splitlines()
    ops = collections.Counter(m.group(1) for m in map(_LINE.search, lines) if m)
    ops.pop("NOP", None)
    return ops


def registers(cubin: bytes) -> int:
    """Registers a thread of ``cubin``'s kernel uses (``cuobjdump -res-usage``)."""
    found = re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage"))
    return int(found.group(1)) if found else -1


def launches(block_size: int, tuning: dict, hash_mode: HashMode):
    """The bag kernels' launches of a forward and a dense backward at the setting, compiled
    for sm_90: ``[(launch, bags a program)]``."""
    from robe_torchrec.ops import triton_kernels as tk
    from robe_torchrec.ops.tuning import tuned
    from robe_torchrec.testing.recorded_launches import recorded_launches

    case = random_case(seed=0, dims=[DIM] * FEATURES, batch=BATCH, max_bag=1,
                       fixed_bags=True, block_size=block_size, memory_size=DIM * 1000,
                       empty_fraction=0.0, hash_mode=int(hash_mode),
                       pooling=[int(Pooling.SUM)] * FEATURES)
    grad = torch.zeros(case.batch, case.output_dim)
    with recorded_launches() as made, tk.launch_on_cpu_tensors(), tuned(**tuning):
        tk.forward(*case.forward_args())
        tk.backward_dense(grad, *case.backward_args(grad)[1:])
    # a bag kernel's first grid axis runs over the bags, one a program or a group a program
    return [(launch, FEATURES * BATCH // launch.grid[0]) for launch in made
            if launch.name in _BAG_KERNELS]


def measure(block_sizes: Sequence[int], variants: Dict[str, dict]) -> List[dict]:
    rows = []
    labels = [(label, tuning, HashMode.REFERENCE) for label, tuning in variants.items()]
    labels.append((MIX, {}, HashMode.MIX))
    for z in block_sizes:
        for label, tuning, mode in labels:
            for launch, bags in launches(z, tuning, mode):
                kernel = launch.variant
                ops = sass_counts(kernel.asm["cubin"])
                total, warps = sum(ops.values()), kernel.metadata.num_warps
                rows.append({"Z": z, "variant": label, "kernel": launch.name,
                             "bags_a_program": bags, "warps": warps, "instructions": total,
                             "warp_instructions_a_bag": total * warps / bags,
                             # ptxas checks each IEEE float division's operands once
                             "float_divisions": ops.get("FCHK", 0),
                             # a program's barriers and memory fences, which every warp waits at
                             "barriers": ops.get("BAR", 0) + ops.get("MEMBAR", 0),
                             "registers": registers(kernel.asm["cubin"]),
                             "shared_bytes": kernel.metadata.shared,
                             "top_opcodes": dict(ops.most_common(6))})
                print(f"Z={z} {label:42s} {launch.name:28s} {total:5d} instr x {warps} warps / "
                      f"{bags} bags", flush=True)
    return rows


def report(rows: List[dict], command: str, compiler: str) -> List[str]:
    lines = header("SASS instructions a bag of the bag kernels, compiled for an H100 (sm_90)",
                   command, f"compiler: {compiler}",
                   f"setting: {FEATURES} features of dim {DIM}, one id a bag, sum pooling, int64 "
                   "ids, float32, reference hash unless the row says otherwise (the paper's; the "
                   "batch only has to specialise as 10240 does)",
                   "compiled by Triton for sm_90 through a stand-in driver, disassembled with "
                   "the cuobjdump Triton ships; no GPU")
    for kernel in sorted({r["kernel"] for r in rows}, key=lambda k: "backward" in k):
        lines += [f"## `{kernel}`", ""]
        cells = []
        for z in sorted({r["Z"] for r in rows}):
            mine = [r for r in rows if r["kernel"] == kernel and r["Z"] == z]
            base = next((r for r in mine if r["variant"] == "default"), None)
            for r in mine:
                rel = (r["warp_instructions_a_bag"] / base["warp_instructions_a_bag"]
                       if base else float("nan"))
                cells.append([z, r["variant"], r["bags_a_program"], r["warps"],
                              r["instructions"], f"{r['warp_instructions_a_bag']:.0f}",
                              f"{rel:.2f}", r["float_divisions"], r["barriers"],
                              r["registers"], r["shared_bytes"]])
        lines += table(["Z", "variant", "bags a program", "warps", "instructions a program",
                        "warp instructions a bag", "/ default", "float divisions",
                        "barriers and fences", "registers a thread", "shared bytes"],
                       cells) + [""]
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser("kernel_instructions", __doc__)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[32, 128])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help="which launch variants (labels of VARIANTS)")
    p.add_argument("--out", default=None, help="folder (or .md file) for the report")
    args = p.parse_args(argv)
    from robe_torchrec.ops import triton_kernels as tk

    if tk.interpreted():
        p.error("unset TRITON_INTERPRET: this compiles the kernels")
    rows = measure(args.block_sizes, {v: VARIANTS[v] for v in args.variants})
    compiler = toolchain()
    publish(args.out, "kernel_instructions",
            report(rows, command_line("kernel_instructions", argv), compiler),
            {"compiler": compiler, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
