"""Where the Triton forward's time goes, and how its launch shape changes it.

At the GPU check's setting (batch 10240, dim 128, the 26 Criteo Kaggle tables, one id per
bag, reference hash, :func:`benchmarks.gpu_check.robe_inputs`), for Z = 32 and 128:

1. **breakdown** of ``torch.ops.robe.forward``: the whole op, with its input checks deferred
   (the default on CUDA) and read at the call (one synchronisation with the host); the
   checks alone, both ways and one by one; the op with the checks switched off; allocating
   the zeroed output alone; the backward scatter reusing the forward's check, with checks
   of its own, and without checks;
2. **launch shapes**: blocks per program (``BLOCK_B``, set through the column tile), or bags
   a program for the short-bags kernels, times warps per program, forward and backward
   scatter without checks. Every forward output is
   compared bitwise with the default shape's (the shape must never change a result); the
   backward's float32 atomics make it compared to 1e-5 instead.

Rows are timed with CUDA events (``--inner`` calls a sample, ``--reps`` samples taken
round-robin, median). Needs torch and Triton only, like the GPU check::

    python -m benchmarks.triton_tiles --out benchmarks/results/triton_tiles_h200.md

``--cpu`` runs it at tiny sizes in Triton's interpreter, over a few shapes (a smoke test that
``tests/ops/test_torch_only.py`` runs; timings mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from benchmarks.gpu_check import (Setting, Timer, _criteo_ids, cpu_setting, gpu_setting,
                                  publish, robe_inputs, select_device, setting_arguments,
                                  versions)

WARPS = (1, 2, 4, 8)


@contextlib.contextmanager
def launch_shape(col_tile: Optional[int] = None, num_warps: Optional[int] = None,
                 short_bags: Optional[bool] = None, bags_per_program: Optional[int] = None,
                 unchecked_meta: Optional[torch.Tensor] = None,
                 summary_kernel: bool = False):
    """Runs the Triton ops with another column tile, warp count, forward kernel (short bags
    or one bag a program) or bags a program; with the forward's checks in the summary
    kernel instead of counted by the forward kernel (``summary_kernel``); or without input
    checks when ``unchecked_meta`` (the CPU copy of ``table_meta`` the checks would return)
    is given (profiling only: bad input would then reach the kernels)."""
    from robe_torchrec.ops import triton_kernels as tk
    from robe_torchrec.ops.tuning import tuned
    from robe_torchrec.ops.validation import IdCheck

    names = ("check_layout", "check_backward_inputs", "_summarize_inputs", "_counts_in_kernel")
    saved = {name: getattr(tk, name) for name in names}
    changes = {"col_tile": col_tile, "num_warps": num_warps,
               "short_bag_mean": None if short_bags is None else
               float("inf") if short_bags else -1.0,
               "bags_per_program": bags_per_program}
    shape = tuned(**{k: v for k, v in changes.items() if v is not None})
    shape.__enter__()
    if summary_kernel or unchecked_meta is not None:
        tk._counts_in_kernel = lambda *args: False
    if unchecked_meta is not None:
        tk.check_layout = lambda *args, **kwargs: (unchecked_meta, IdCheck(False, None))
        tk._summarize_inputs = lambda *args: True
        tk.check_backward_inputs = lambda *args, **kwargs: unchecked_meta
    try:
        yield
    finally:
        shape.__exit__(None, None, None)
        for name, value in saved.items():
            setattr(tk, name, value)


def _timed(rows: Dict[str, Callable[[], object]], timer: Timer, reps: int, inner: int,
           warmup: int, host: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Median device ms per call of each row; ``host``, if given, gets the median host ms."""
    samples: Dict[str, List[float]] = {name: [] for name in rows}
    host_samples: Dict[str, List[float]] = {name: [] for name in rows}
    for fn in rows.values():
        for _ in range(warmup + 1):
            fn()
    for _ in range(reps):
        for name, fn in rows.items():
            samples[name].append(timer(fn, inner))
            host_samples[name].append(timer.host_ms)
    if host is not None:
        host.update({name: statistics.median(s) for name, s in host_samples.items()})
    return {name: statistics.median(s) for name, s in samples.items()}


def breakdown(setting: Setting, ids: torch.Tensor, device: torch.device, z: int,
              timer: Timer) -> List[str]:
    from robe_torchrec.ops import deferred_checks, triton_kernels as tk
    from robe_torchrec.ops.deferred_checks import defer_checks
    from robe_torchrec.ops.validation import check_inputs

    inputs = robe_inputs(setting, ids, device, z)
    w, flat, grad = inputs.weights, inputs.flat, inputs.grad
    values, offsets, psw, meta, output_dim, _, hash_mode, params, _ = flat
    backward_args = (grad, w, values, offsets, psw, meta, z, hash_mode, params)
    meta_cpu = meta.cpu()
    trainable = w.detach().clone().requires_grad_(True)

    def unchecked(fn):
        def run():
            with launch_shape(unchecked_meta=meta_cpu):
                return fn()
        return run

    def summary(fn):
        def run():
            with launch_shape(summary_kernel=True):
                return fn()
        return run

    def registered_op():
        with torch.no_grad():
            return torch.ops.robe.forward(trainable, *flat)

    def registered_op_with_grad():  # a training forward: records the autograd graph
        with torch.enable_grad():
            return torch.ops.robe.forward(trainable, *flat)

    def checks(defer, fn):
        def run():
            with defer_checks(defer):
                return fn()
        return run

    rows = {
        "torch.ops.robe.forward, no_grad, weights requiring grad": registered_op,
        "torch.ops.robe.forward recording the autograd graph": registered_op_with_grad,
        "forward op, checks deferred": checks(True, lambda: tk.forward(w, *flat)),
        "forward op, checks read at the call": checks(False, lambda: tk.forward(w, *flat)),
        "forward op, checks deferred, by the summary kernel": checks(True, summary(
            lambda: tk.forward(w, *flat))),
        "summary kernel checks alone, deferred": checks(
            True, lambda: check_inputs(w, *flat, tk._summarize_inputs)),
        "summary kernel checks alone, read at the call": checks(
            False, lambda: check_inputs(w, *flat, tk._summarize_inputs)),
        "input checks one by one (no summary kernel)": lambda: check_inputs(w, *flat),
        "forward without checks": unchecked(lambda: tk.forward(w, *flat)),
        "zeroed output alone": lambda: torch.zeros(setting.batch, output_dim, device=device),
        "backward scatter, the forward's check reused": lambda: tk.backward_dense(
            *backward_args),
        # another tensor object for the same ids: no forward checked it, so its own checks
        "backward scatter, its own checks": lambda: tk.backward_dense(
            grad, w, values.view(-1), *backward_args[3:]),
        "backward scatter without checks": unchecked(lambda: tk.backward_dense(*backward_args)),
    }
    host: Dict[str, float] = {}
    medians = _timed(rows, timer, setting.reps, setting.inner, setting.warmup, host)
    deferred_checks.raise_pending_checks()
    whole = medians["forward op, checks deferred"]
    out = [f"### Z = {z}: where the op's time goes", "",
           "Device ms: CUDA events around back-to-back calls; host ms: the host's time to "
           "issue them (the same as the device's when the host limits the calls).", "",
           "| part | device ms | / forward op | host ms |", "|---|---|---|---|"]
    out += [f"| {name} | {ms:.4f} | {ms / whole:.2f} | {host[name]:.4f} |"
            for name, ms in medians.items()]
    return out + [""]


def shapes(setting: Setting, ids: torch.Tensor, device: torch.device, z: int,
           timer: Timer, quick: bool = False) -> List[str]:
    """The launch-shape sweep (``quick``: a few shapes, for the interpreter)."""
    from robe_torchrec.ops import triton_kernels as tk

    inputs = robe_inputs(setting, ids, device, z)
    w, flat, grad = inputs.weights, inputs.flat, inputs.grad
    values, offsets, psw, meta, _, _, hash_mode, params, _ = flat
    block_z = 1 << (min(z, setting.dim) - 1).bit_length()
    num_blocks = -(-setting.dim // z)
    widest = 1 << (num_blocks - 1).bit_length()
    block_bs = sorted({min(1 << k, widest) for k in range(num_blocks.bit_length() + 1)})
    tiles = tk._Tiles(setting.dim, z, values.numel(), offsets.numel() - 1)
    meta_cpu = meta.cpu()
    with launch_shape(unchecked_meta=meta_cpu):
        expected = tk.forward(w, *flat)
        expected_grad = tk.backward_dense(grad, w, values, offsets, psw, meta, z, hash_mode,
                                          params)
    # (kernel, BLOCK_B, bags a program, warps): one bag a program over BLOCK_B, then the
    # short-bags kernel over bags a program, each at every warp count
    warp_counts = (1,) if quick else WARPS
    bag_counts = (1, 4) if quick else (1, 2, 4, 8, 16, 32)
    if quick:
        block_bs = [tiles.block_b]
    shape_keys = [("per bag", bb, 1, warps) for bb in block_bs for warps in warp_counts]
    shape_keys += [("short bags", tiles.block_b, bags, warps) for bags in bag_counts
                   for warps in warp_counts]
    default = ("short bags" if tiles.short_bags else "per bag", tiles.block_b,
               tiles.block_bags if tiles.short_bags else 1,
               tiles.short_bags_warps if tiles.short_bags else tiles.num_warps)
    rows, notes = {}, {}
    for key in shape_keys:
        kernel, block_b, bags, warps = key
        shape = dict(col_tile=block_b * block_z, num_warps=warps, unchecked_meta=meta_cpu,
                     short_bags=kernel == "short bags", bags_per_program=bags)

        def fwd(shape=shape):
            with launch_shape(**shape):
                return tk.forward(w, *flat)

        def bwd(shape=shape):
            with launch_shape(**shape):
                return tk.backward_dense(grad, w, values, offsets, psw, meta, z, hash_mode,
                                         params)

        rows[f"forward {key}"], rows[f"backward {key}"] = fwd, bwd
        notes[key] = (torch.equal(fwd(), expected),
                      float((bwd() - expected_grad).abs().max()))
    medians = _timed(rows, timer, setting.reps, setting.inner, setting.warmup)
    base = medians[f"forward {default}"]
    base_backward = medians[f"backward {default}"]
    out = [f"### Z = {z}: launch shapes (checks off)", "",
           f"Default: {default[0]} kernels, BLOCK_B = {default[1]}, {default[2]} bags a "
           f"program, {default[3]} warps. The backward follows the forward's kernel choice.",
           "", "| kernel | BLOCK_B | bags a program | warps | forward ms | / default | "
           "backward ms | / default | forward bitwise equal | backward max abs diff |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for key, (equal, err) in notes.items():
        f, b = medians[f"forward {key}"], medians[f"backward {key}"]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {f:.4f} | {f / base:.2f} | "
                   f"{b:.4f} | {b / base_backward:.2f} | {'yes' if equal else 'NO'} | "
                   f"{err:.2e} |")
    return out + [""]


def host_profile(setting: Setting, ids: torch.Tensor, device: torch.device, z: int,
                 calls: int = 200) -> List[str]:
    """Where the host spends a registered forward's time (cProfile, ``calls`` calls): on a
    GPU the op is short enough for its Python to matter."""
    from benchmarks.gpu_speed import profile_calls

    inputs = robe_inputs(setting, ids, device, z)
    w, flat = inputs.weights, inputs.flat
    with torch.no_grad():
        lines = profile_calls(lambda: torch.ops.robe.forward(w, *flat), calls, 25)
    return [f"### Z = {z}: host profile of {calls} calls of torch.ops.robe.forward", "",
            "```", *lines, "```", ""]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.triton_tiles",
                                description=__doc__.split("\n\n")[0])
    setting_arguments(p, reps=15)
    p.add_argument("--profile", action="store_true", help="also profile the host side")
    args = p.parse_args(argv)
    args.argv = list(argv)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    device = select_device(args.cpu, "triton_tiles")
    if device is None:
        return 2
    setting = cpu_setting(args) if args.cpu else gpu_setting(args)
    from robe_torchrec.ops import cpu_backend

    timer = Timer(device)
    ids = _criteo_ids(setting, device)
    body: List[str] = []
    # CPU tensors reach the Triton kernels only when asked; CUDA ones always do
    with cpu_backend("triton") if args.cpu else contextlib.nullcontext():
        for z in setting.block_sizes:
            body += breakdown(setting, ids, device, z, timer)
            body += shapes(setting, ids, device, z, timer, quick=args.cpu)
            if args.profile and z == setting.block_sizes[0]:
                body += host_profile(setting, ids, device, z, calls=2 if args.cpu else 200)
            print("\n".join(body[-40:]), flush=True)
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "benchmarks.triton_tiles",
                                                *args.argv])
    text = "\n".join(
        ["# Triton forward: where the time goes, and launch shapes", "",
         f"- command: `{command}`",
         f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall "
         f"time {time.perf_counter() - start:.0f} s",
         *versions(device),
         f"- batch {setting.batch}, dim {setting.dim}, {len(setting.cardinalities)} features, "
         f"one id per bag, array {setting.compression:g}x smaller than the tables; median of "
         f"{setting.reps} samples of {setting.inner} calls, rows interleaved", "", *body])
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
