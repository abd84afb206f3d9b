"""Check, without a GPU, that the cached launches (:mod:`robe_torchrec.ops.triton_launch`)
give every launch of the ops the compiled variant and the arguments ``JITFunction.run``
gives it.

A stand-in CUDA driver (:mod:`robe_torchrec.testing.recorded_launches`) compiles the
kernels for sm_90 and records each launch instead of making it. Every scenario runs all the
ops' host wrappers (those of ``tests/ops/sm90_launches.py``) on CPU tensors standing in for
CUDA ones three times: through ``JITFunction.run`` only, once more cached (which remembers
the variants), and cached again, where no launch may reach ``JITFunction.run``. The first
and the last must record the same launches: the same compiled variant object, grid,
stream, and arguments (tensors by dtype, shape, strides and 16-byte alignment, which Triton
specialises on; the rest by value). One scenario passes ids at an address that is not
16-byte aligned, after an aligned run of the same shape: a different variant, which a
cache keyed on anything less than Triton's specialisation would miss. Then: a pre-run hook
on a kernel still runs at each of its launches, and at the paper's scale (batch 10240, 26
tables) the launches agree too and every grid fits CUDA's limits.

``tests/ops/test_triton_kernel.py`` runs it in a fresh process; it exits non-zero on the
first difference, naming the scenario and the launch.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, List

import torch
import triton
import triton.language as tl
from triton.compiler import make_backend
from triton.runtime import jit

from robe_torchrec.hashing import HashMode
from robe_torchrec.ops import triton_kernels as tk
from robe_torchrec.ops.meta import Optimizer
from robe_torchrec.ops.triton_launch import argument_key
from robe_torchrec.ops.tuning import tuned
from robe_torchrec.testing.op_cases import OpCase, random_case
from robe_torchrec.testing.recorded_launches import SM90, Launch, recorded_launches
from tests.ops.sm90_launches import run_ops, scenarios

_jit_runs = 0


def _counting(run):
    def counted(self, *args, **kwargs):
        global _jit_runs
        _jit_runs += 1
        return run(self, *args, **kwargs)
    return counted


def _described(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride(),
                value.data_ptr() % 16 == 0)
    return value


def _summary(launch: Launch) -> str:
    return (f"variant {id(launch.variant):#x}, grid {launch.grid}, stream {launch.stream}, "
            f"args {[_described(a) for a in launch.args]}")


def _recorded(case, ops: Callable[[OpCase], None]) -> List[Launch]:
    with recorded_launches() as launches, tk.launch_on_cpu_tensors():
        ops(case)
    return launches


def paper_ops(case: OpCase) -> None:
    """What a training step launches at the paper's scale: forward, dense gradient, fused
    Adagrad (the stand-in also checks every grid against CUDA's limits)."""
    tk.forward(*case.forward_args())
    grad = torch.zeros(case.batch, case.output_dim)
    tk.backward_dense(grad, *case.backward_args(grad)[1:])
    state = torch.zeros_like(case.weights)
    tk.backward_fused_(grad, case.weights, state, state.new_empty(0), case.values,
                       case.offsets, None, case.table_meta, case.block_size, case.hash_mode,
                       case.hash_params, int(Optimizer.ADAGRAD), [0.1, 1e-8, 0.9, 0.999, 0.0],
                       1)


def paper_case(ids_per_bag: int) -> OpCase:
    """Batch 10240, the 26 Criteo features of dim 128, Z = 32, an array 1000x smaller than
    the 33.8M-row tables; ``ids_per_bag`` ids in every bag."""
    return random_case(seed=ids_per_bag, dims=[128] * 26, batch=10240, max_bag=ids_per_bag,
                       block_size=32, memory_size=4_321_609, num_rows=[1_298_561] * 26,
                       pooling=[0] * 26, empty_fraction=0.0, fixed_bags=True)


def _misaligned(case):
    """``case`` with its ids and offsets 8 bytes past a 16-byte boundary."""
    for name in ("values", "offsets"):
        tensor = getattr(case, name)
        pad = 8 // tensor.element_size()
        view = torch.zeros(tensor.numel() + pad, dtype=tensor.dtype)[pad:]
        view.copy_(tensor)
        assert view.data_ptr() % 16 == 8
        setattr(case, name, view)
    return case


def check(label: str, case: OpCase, ops: Callable[[OpCase], None] = run_ops) -> List[Launch]:
    global _jit_runs
    with tuned(cached_launch=False):
        through_jit = _recorded(case, ops)
    _recorded(case, ops)  # remembers the variants
    _jit_runs = 0
    cached = _recorded(case, ops)
    if _jit_runs:
        raise AssertionError(f"{label}: {_jit_runs} cached launches went through "
                             "JITFunction.run")
    if len(cached) != len(through_jit):
        raise AssertionError(f"{label}: {len(cached)} launches cached, {len(through_jit)} "
                             "through JITFunction.run")
    for i, (want, got) in enumerate(zip(through_jit, cached)):
        same = (want.variant is got.variant and want.grid == got.grid
                and want.stream == got.stream
                and [_described(a) for a in want.args] == [_described(a) for a in got.args])
        if not same:
            raise AssertionError(f"{label}: launch {i} ({want.name}) differs:\n"
                                 f"  JITFunction.run: {_summary(want)}\n"
                                 f"  cached: {_summary(got)}")
    print("scenario", label, f"{len(cached)} launches agree", flush=True)
    return cached


def check_pre_run_hooks(case: OpCase) -> None:
    """A pre-run hook on a kernel (a profiler's, say) is honoured: its launches then go
    through ``JITFunction.run``, which runs the hook."""
    seen = []

    def hook(*args, **kwargs):
        seen.append(1)

    kernels = (tk._forward_kernel, tk._forward_short_bags_kernel)
    for kernel in kernels:
        kernel.add_pre_run_hook(hook)
    try:
        with recorded_launches() as launches, tk.launch_on_cpu_tensors():
            tk.forward(*case.forward_args())
    finally:
        for kernel in kernels:
            kernel.pre_run_hooks.remove(hook)
    hooked = [launch for launch in launches
              if launch.name in ("_forward_kernel", "_forward_short_bags_kernel")]
    if not hooked or len(seen) != len(hooked):
        raise AssertionError(f"a forward with a pre-run hook: {len(seen)} hook calls, "
                             f"{len(hooked)} launches of the hooked kernels")
    print("scenario pre-run hook honoured", flush=True)


def check_nested_recordings(case: OpCase) -> None:
    """A recording inside another gets its block's launches; the outer one, after it, still
    records (its stand-in driver still active)."""
    with recorded_launches() as outer, tk.launch_on_cpu_tensors():
        with recorded_launches() as inner:
            tk.forward(*case.forward_args())
        tk.forward(*case.forward_args())
    if not inner or len(outer) != len(inner):
        raise AssertionError(f"nested recordings: {len(inner)} launches inside, {len(outer)} "
                             "after it in the outer block (want the same, not 0)")
    print("scenario nested recordings", flush=True)


@triton.jit(do_not_specialize=["unspecialized"],
            do_not_specialize_on_alignment=["unaligned"])
def _one_of_each(plain, unspecialized, unaligned, annotated: tl.int64, const_ptr: tl.const):
    pass


def _probe_values() -> list:
    """Arguments of every type the ops pass, at the edges of what Triton specialises on:
    ints around 1, multiples of 16 and the int32/int64/uint64 limits, floats, bools, None,
    tensors of several dtypes at several byte offsets from a 16-byte boundary."""
    edges = [0, 2**31, 2**32, 2**63, 2**64]
    ints = {e + d for e in edges for d in (-17, -16, -15, -2, -1, 0, 1, 2, 15, 16, 17)}
    ints |= {-i for i in ints} | {1, 3, 26, 48, 10240, 53248}
    floats = [0.0, -0.0, 1.0, 0.5, 16.0, 1e300, -1e-300, math.inf, math.nan]
    tensors = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
                  torch.int64, torch.int8, torch.uint8, torch.bool):
        size = torch.empty(0, dtype=dtype).element_size()
        block = torch.zeros(64, dtype=dtype)
        assert block.data_ptr() % 16 == 0
        tensors += [block[offset // size:] for offset in (0, 1, 2, 4, 8, 16, 24, 32)
                    if offset % size == 0]
    return sorted(ints) + floats + [True, False, None] + tensors


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor at {value.data_ptr() % 16} bytes past 16"
    return repr(value)


def check_argument_keys() -> None:
    """The promise of the cached launches' key (:func:`argument_key`), against the Triton
    this runs under: arguments of one key get one specialisation, for each way a kernel
    parameter is specialised (plainly, not at all, not on alignment, by its annotation, as a
    constant pointer)."""
    binder = jit.create_function_from_signature(
        _one_of_each.signature, _one_of_each.params, make_backend(SM90))
    values = _probe_values()
    for position in range(len(_one_of_each.params)):
        seen = {}
        for value in values:
            args = [0] * len(_one_of_each.params)
            args[position] = value
            try:
                specialization = binder(*args)[1][position]
            except Exception:  # a value Triton refuses is never launched, let alone cached
                continue
            key = argument_key((value,), {})
            if key is None:
                raise AssertionError(f"no key for a {type(value).__name__} argument")
            first = seen.setdefault(key, (value, specialization))
            if first[1] != specialization:
                raise AssertionError(
                    f"parameter {_one_of_each.params[position].name}: {_shown(first[0])} and "
                    f"{_shown(value)} have one key {key} but Triton specialises them as "
                    f"{first[1]} and {specialization}")
    keys = {argument_key((v,), {}) for v in values if isinstance(v, torch.Tensor)}
    assert len(keys) > 2, keys  # the tensors do not all share one key: the check can fail
    print(f"scenario argument keys: {len(values)} values, one specialisation a key",
          flush=True)


def main() -> int:
    assert not tk.interpreted(), "unset TRITON_INTERPRET: this compiles the kernels"
    jit.JITFunction.run = _counting(jit.JITFunction.run)
    check_argument_keys()
    shapes = scenarios()
    picked = [shapes[0], shapes[1], shapes[6], shapes[8]]  # 1 and 16 bags, long bags
    for i, shape in enumerate(picked):
        mode = (HashMode.REFERENCE, HashMode.MIX)[i % 2]
        case = random_case(seed=i, hash_mode=int(mode), weighted=i % 2 == 1,
                           index_dtype=(torch.int64, torch.int32)[i // 2 % 2], **shape)
        aligned = check(f"{shape} hash={mode.name.lower()}", case)
    misaligned = check(f"{shape} ids not 16-byte aligned", _misaligned(case))
    if all(a.variant is b.variant for a, b in zip(aligned, misaligned)):
        raise AssertionError("misaligned ids launched the aligned variants: the scenario "
                             "tests nothing")
    check_pre_run_hooks(case)
    check_nested_recordings(case)
    for ids_per_bag in (1, 20):
        check(f"paper scale, {ids_per_bag} id(s) a bag", paper_case(ids_per_bag), paper_ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
