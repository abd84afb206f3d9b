"""How fast is the unpooled ROBE-Z lookup (``RobeEmbeddingCollection``), against its floors
and its peers? On CPU by default; ``--device cuda`` times the same rows on a GPU, each call
followed by a synchronisation (``benchmarks.gpu_torchrec.run`` runs it there).

``--batch`` samples of ``--history`` ids, one table of ``--rows`` x ``--dim`` in ``--memory``
floats. A forward and a step (forward, sum, backward with SGD fused) of: the floors (the
output written from a cache-resident 256-row table, the gradient scattered back into it);
the unpooled module with 1 feature, and with 4 holding 55/25/15/5 % of the ids: of one table,
of 4 tables on one array (both looked up as one feature of keys), and of 4 tables on an array
each (``shared=False``: padded, ``4 * max n_f - n`` zero rows written and a gather); the
4 skewed features' forward under ``torch.compile(fullgraph=True)`` (``--compile-backend``),
with the module's keys layout and, its ``keys_table_meta`` buffer removed, padded; the
pooled module, one id a bag; TorchRec's ``EmbeddingCollection`` on the full table::

    python -m benchmarks.unpooled_ops --iters 25 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim import apply_optimizer_in_backward

from benchmarks.common import (command_line, header, interleaved, keep_freed_memory, medians_ms,
                               parser, publish, table)
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection, RobeEmbeddingCollection
from robe_torchrec.ops import raise_pending_checks

SKEW = (0.55, 0.25, 0.15, 0.05)
ONE, FOUR, POOLED = "unpooled, 1 feature", "unpooled, 4 features (skewed)", "pooled, one id per bag"
FOUR_TABLES = "unpooled, 4 features (skewed), 4 tables on one array"
FOUR_ARRAYS = "unpooled, 4 features (skewed), 4 tables, an array each (padded)"
COMPILED = "unpooled, 4 features (skewed), compiled"
COMPILED_PADDED = "unpooled, 4 features (skewed), compiled without keys_table_meta (padded)"


def _kjt(keys: List[str], ids: torch.Tensor, counts: List[int], per_bag: int) -> KeyedJaggedTensor:
    """Feature-major ids, ``counts[f]`` of feature ``f``, in bags of ``per_bag`` ids."""
    bags = max(c // per_bag for c in counts)
    lengths = [[per_bag] * (c // per_bag) + [0] * (bags - c // per_bag) for c in counts]
    return KeyedJaggedTensor.from_lengths_sync(keys, ids, torch.tensor(sum(lengths, [])))


def build_rows(args: argparse.Namespace) -> Dict[str, Callable[[], object]]:
    n = args.batch * args.history
    device = torch.device(args.device)
    ids = torch.randint(0, args.rows, (n,), generator=torch.Generator().manual_seed(0))
    robe = RobeConfig(memory_size=args.memory, block_size=args.block_size)

    def fused(module):
        module = module.to(device)
        apply_optimizer_in_backward(torch.optim.SGD, [module.weight], {"lr": 0.01})
        return module

    def tables(keys, cls=EmbeddingConfig):
        return [cls(name="item_table", embedding_dim=args.dim, num_embeddings=args.rows,
                    feature_names=keys)]

    def table_each(keys):  # each feature its own table, of a quarter of the rows
        return [EmbeddingConfig(name=f"{k}_table", embedding_dim=args.dim,
                                num_embeddings=args.rows // len(keys), feature_names=[k])
                for k in keys]

    keys4 = [f"h{i}" for i in range(4)]
    counts4 = [int(n * s) // args.history * args.history for s in SKEW]
    history = _kjt(["history"], ids, [n], args.history)
    four = _kjt(keys4, ids[: sum(counts4)] % (args.rows // len(keys4)), counts4, args.history)
    separate = dataclasses.replace(robe, shared=False)
    modules = {ONE: (fused(RobeEmbeddingCollection(tables(["history"]), robe)), history),
               FOUR: (fused(RobeEmbeddingCollection(tables(keys4), robe)),
                      _kjt(keys4, ids[: sum(counts4)], counts4, args.history)),
               FOUR_TABLES: (fused(RobeEmbeddingCollection(table_each(keys4), robe)), four),
               FOUR_ARRAYS: (fused(RobeEmbeddingCollection(table_each(keys4), separate)), four),
               POOLED: (fused(RobeEmbeddingBagCollection(tables(["history"], EmbeddingBagConfig),
                                                         robe)), _kjt(["history"], ids, [n], 1)),
               "stock EmbeddingCollection": (EmbeddingCollection(tables(["history"]),
                                                                 device=device), history)}
    modules = {name: (module, kjt.to(device)) for name, (module, kjt) in modules.items()}
    source, small_ids = torch.randn(256, args.dim, device=device), (ids % 256).to(device)
    out, grad = (torch.empty(n, args.dim, device=device),
                 torch.randn(n, args.dim, device=device))
    rows = {"forward floor": lambda: torch.index_select(source, 0, small_ids, out=out),
            "step floor": lambda: (torch.index_select(source, 0, small_ids, out=out),
                                   source.index_add_(0, small_ids, grad, alpha=0.0))}

    def total(output) -> torch.Tensor:  # a dict of JaggedTensors summed per feature, not copied
        if isinstance(output, dict):
            return sum(jt.values().sum() for jt in output.values())
        return output.values().sum()  # a KeyedTensor

    for name, (module, kjt) in modules.items():
        rows[f"{name}: forward"] = lambda m=module, k=kjt: m(k)
        rows[f"{name}: step"] = lambda m=module, k=kjt: total(m(k)).backward()
    # a traced graph takes the keys layout from the module's buffer; without it, padded
    module, kjt = modules[FOUR]
    padded = copy.deepcopy(module)
    padded.keys_table_meta = None
    for name, m in ((COMPILED, module), (COMPILED_PADDED, padded)):
        compiled = torch.compile(m, fullgraph=True, backend=args.compile_backend)
        rows[f"{name}: forward"] = lambda c=compiled, k=kjt: c(k)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    p = parser("unpooled_ops", __doc__)
    for flag, default in (("batch", 2048), ("history", 32), ("dim", 64), ("rows", 1_000_000),
                          ("memory", 2_621_440), ("block-size", 32), ("threads", 1), ("warmup", 3),
                          ("iters", 15)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--keep-freed-mib", type=int, default=1024,
                   help="glibc's malloc keeps freed blocks up to this size (32: the most it "
                        "keeps by itself)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    p.add_argument("--out", default=None, help="a folder (unpooled_ops.md) or a .md file")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.history, args.rows, args.memory, args.dim = 16, 4, 1000, 4096, 8
        args.warmup, args.iters, args.compile_backend = 1, 2, "aot_eager"
    torch.set_num_threads(args.threads)
    # outputs reuse freed memory, as a training loop's do up to glibc's 32 MiB, and beyond it
    # up to --keep-freed-mib (the padded layout's output is larger than the rows asked for)
    allocator = (keep_freed_memory(args.keep_freed_mib) if args.device == "cpu"
                 else "CUDA's caching allocator")
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    fns = {name: (lambda it, fn=fn: (fn(), synchronize()))
           for name, fn in build_rows(args).items()}
    ms = {k: v["wall"] for k, v in medians_ms(interleaved(fns, args.iters, args.warmup)).items()}
    raise_pending_checks()  # (a GPU's checks are read later: none may be left unread)
    ratios = {"unpooled / pooled, forward": ms[f"{ONE}: forward"] / ms[f"{POOLED}: forward"],
              "unpooled / pooled, step": ms[f"{ONE}: step"] / ms[f"{POOLED}: step"],
              "4 skewed features / 1, forward": ms[f"{FOUR}: forward"] / ms[f"{ONE}: forward"],
              "4 skewed features / 1, step": ms[f"{FOUR}: step"] / ms[f"{ONE}: step"],
              "4 tables on one array / 1 feature, forward":
                  ms[f"{FOUR_TABLES}: forward"] / ms[f"{ONE}: forward"],
              "4 tables, an array each (padded) / 4 tables on one array, forward":
                  ms[f"{FOUR_ARRAYS}: forward"] / ms[f"{FOUR_TABLES}: forward"],
              "4 tables, an array each (padded) / 4 tables on one array, step":
                  ms[f"{FOUR_ARRAYS}: step"] / ms[f"{FOUR_TABLES}: step"],
              "4 skewed features compiled / eager, forward":
                  ms[f"{COMPILED}: forward"] / ms[f"{FOUR}: forward"],
              "4 skewed features compiled without keys_table_meta (padded) / with, forward":
                  ms[f"{COMPILED_PADDED}: forward"] / ms[f"{COMPILED}: forward"]}
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = header(f"Unpooled ROBE-Z lookup on {where} (`RobeEmbeddingCollection`)",
                   command_line("unpooled_ops", argv), f"allocator: {allocator}",
                   f"{args.batch * args.history:,} ids ({args.batch} x {args.history}), dim "
                   f"{args.dim}, table {args.rows:,} rows, ROBE array {args.memory:,} floats, Z = "
                   f"{args.block_size}, {args.threads} thread(s); median of {args.iters} "
                   "interleaved rounds (ms)")
    lines += table(["row", "ms", "x forward floor", "x step floor"],
                   [[k, f"{t:.2f}", f"{t / ms['forward floor']:.1f}x",
                     f"{t / ms['step floor']:.1f}x"] for k, t in ms.items()])
    lines += [""] + [f"- {k}: {v:.2f}x" for k, v in ratios.items()]
    result = {"command": command_line("unpooled_ops", argv), "args": vars(args), "ms": ms,
              "ratios": ratios, "allocator": allocator}
    publish(args.out, "unpooled_ops", lines, result)
    return result


if __name__ == "__main__":
    main()
