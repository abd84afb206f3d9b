"""Compile, for an H100 (sm_90), every Triton kernel variant the host wrappers launch on a
set of shapes chosen to hit Triton's argument specialisations. No GPU needed.

Triton specialises the integer arguments of a launch by value: an argument equal to 1
becomes the constant ``1`` inside the kernel (a Python int, not a tensor: ``x.to(...)``
fails), and a multiple of 16 is marked divisible. The interpreter, which CI runs the
kernels in, specialises nothing, so a kernel can pass every interpreted test and still
fail to compile for a one-feature model. This script runs the real host wrappers of
:mod:`robe_torchrec.ops.triton_kernels` on CPU tensors with ``JITFunction.run`` replaced by
"bind the arguments as the launcher does, then compile for sm_90 and do not launch": the
same specialisation code, the same compile pipeline, only the launch left out. A variant that
needs more shared memory or threads than an H100 gives a program fails too.

``--arch 80`` (or 86, 89) compiles for another compute capability instead, with its own
shared-memory limit. Every variant compiles for an A100 as well (run by hand, not in CI:
benchmarks/results/probes/sm80_compile.md).

``tests/ops/test_triton_kernel.py`` runs it in a fresh process (a process that imported
``triton.language`` interpreted cannot compile). It prints one ``compiled`` line per
distinct variant and ``scenario`` per shape, and exits non-zero on the first failure,
naming the shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from typing import Dict, List, Optional, Sequence

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit

from robe_torchrec.hashing import HashMode
from robe_torchrec.ops import defer_checks, raise_pending_checks
from robe_torchrec.ops import meta as m
from robe_torchrec.ops import triton_kernels as tk
from robe_torchrec.ops.tuning import tuned
from robe_torchrec.testing.op_cases import random_case
from robe_torchrec.testing.recorded_launches import MAX_SHARED, SM90, load_refusal

#: what the kernels are compiled for (``main`` sets it from ``--arch``)
_target = SM90
_compiled: Dict[str, object] = {}
#: flags printed with the specialised arguments, for the test to see they were compiled
_NAMED_FLAGS = ("GUARDED", "UNDO_STEP", "OPTIMIZER", "STEP_ON_DEVICE")


def _compile_only(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` without the device: bind and specialise the arguments with the
    launcher's own binder, compile the variant once, never launch."""
    backend = make_backend(_target)
    binder = jit.create_function_from_signature(self.signature, self.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    key = f"{self.fn.__name__}:{specialization}:{options}"
    if key not in _compiled:
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args,
                                                                specialization, options)
        _compiled[key] = triton.compile(ASTSource(self, signature, constexprs, attrs),
                                        target=_target, options=options.__dict__)
        refusal = load_refusal(_compiled[key])
        if refusal:
            raise RuntimeError(refusal)
        constants = {self.arg_names[path[0]]: value for path, value in constexprs.items()
                     if self.arg_names[path[0]].islower()
                     or self.arg_names[path[0]] in _NAMED_FLAGS}
        print("compiled", self.fn.__name__, constants, flush=True)
    return _compiled[key]


def scenarios() -> List[dict]:
    """Shapes whose integer arguments take the values Triton treats apart: 1 (features,
    batch, ids, output width, rows, array span), multiples of 16, and neither."""
    out = []
    for features, batch in ((1, 1), (1, 16), (1, 7), (3, 1), (2, 32)):
        out.append(dict(dims=[128] * features, batch=batch, max_bag=1, block_size=32,
                        empty_fraction=0.0))
    out += [
        dict(dims=[1], batch=1, max_bag=1, block_size=1, empty_fraction=0.0),  # width 1
        dict(dims=[1], batch=5, max_bag=40, block_size=1, empty_fraction=0.0),  # long bags
        dict(dims=[16], batch=1, max_bag=30, block_size=16, memory_size=16,
             empty_fraction=0.0),                                 # span 1, one bag
        dict(dims=[7, 33], batch=3, max_bag=500, block_size=5, empty_fraction=0.3),
        dict(dims=[512], batch=1, max_bag=2, block_size=256, memory_size=4096),
        dict(dims=[3, 5], batch=2, max_bag=0),                    # no ids at all
    ]
    return out


def run_ops(case) -> None:
    weights, acc = case.weights, m.accumulation_dtype(case.weights.dtype)
    tk.forward(*case.forward_args())
    grad = torch.zeros(case.batch, case.output_dim, dtype=acc)
    tk.backward_dense(grad, *case.backward_args(grad)[1:])
    # inputs no forward checked: the backward launches the summary kernel of its own
    tk.backward_dense(grad, weights, case.values.clone(), case.offsets.clone(),
                      *case.backward_args(grad)[4:])
    with tuned(deterministic_backward=True):  # the gradient summed in a fixed order
        tk.backward_dense(grad, *case.backward_args(grad)[1:])
    with tuned(compact_hash=True):  # each (id, block) pair hashed in a tile of its own
        tk.forward(*case.forward_args())
        tk.backward_dense(grad, *case.backward_args(grad)[1:])
    if case.per_sample_weights is not None:
        tk.per_sample_weights_grad(grad, *case.psw_grad_args(grad)[1:])
    # the rate as a float, and read by the kernel from the optimizer's rate tensor
    rates = (None, torch.tensor(0.1, dtype=torch.float64))
    for optimizer, rate in itertools.product(m.Optimizer, rates):
        rows = m.rowwise_state_size(weights.numel(), case.block_size)
        shape = (rows,) if optimizer == m.Optimizer.ROWWISE_ADAGRAD else weights.shape
        state1, state2 = torch.zeros(shape, dtype=acc), torch.zeros(weights.shape, dtype=acc)
        tk.backward_fused_(grad, weights, state1, state2, case.values, case.offsets,
                           case.per_sample_weights, case.table_meta, case.block_size,
                           case.hash_mode, case.hash_params, int(optimizer),
                           [0.1, 1e-8, 0.9, 0.999, 0.0], 1, rate)
    # Adam's step counted on the device (capturable): the kernel computes its bias
    # correction itself, in float64 (exp2, log2)
    for rate in rates:
        state = torch.zeros(weights.shape, dtype=acc)
        tk.counted_backward_fused_(grad, weights, state, state.clone(), torch.zeros(()),
                                   int(m.Optimizer.ADAM), [0.1, 1e-8, 0.9, 0.999, 0.0],
                                   case.values, case.offsets, case.per_sample_weights,
                                   case.table_meta, case.block_size, case.hash_mode,
                                   case.hash_params, rate)
    run_deferred_ops(case, grad)
    tk.block_starts(case.values, -(-max(case.table_meta[m.DIM].tolist()) // case.block_size),
                    int(case.table_meta[m.W_SIZE, 0]), case.block_size, case.hash_mode,
                    case.hash_params)


def run_deferred_ops(case, grad: torch.Tensor) -> None:
    """The launches of a GPU's default: checks deferred, so the backward kernels guard
    their writes with the forward's counts (``GUARDED``), and an optimizer's step counted
    on the device is taken back when the guard stops them (``UNDO_STEP``)."""
    # inputs of their own: those the immediate checks passed need no guard
    case = dataclasses.replace(case, values=case.values.clone(), offsets=case.offsets.clone())
    weights, acc = case.weights, m.accumulation_dtype(case.weights.dtype)
    hparams = [0.1, 1e-8, 0.9, 0.999, 0.0]
    with defer_checks(True):
        tk.forward(*case.forward_args())
        tk.backward_dense(grad, *case.backward_args(grad)[1:])
        with tuned(deterministic_backward=True):
            tk.backward_dense(grad, *case.backward_args(grad)[1:])
        if case.per_sample_weights is not None:
            tk.per_sample_weights_grad(grad, *case.psw_grad_args(grad)[1:])
        lookup = case.backward_args(grad)[2:]
        for optimizer in m.Optimizer:
            rows = m.rowwise_state_size(weights.numel(), case.block_size)
            shape = (rows,) if optimizer == m.Optimizer.ROWWISE_ADAGRAD else weights.shape
            state1, state2 = torch.zeros(shape, dtype=acc), torch.zeros(weights.shape, dtype=acc)
            tk.backward_fused_(grad, weights, state1, state2, *lookup, int(optimizer), hparams,
                               1)
            tk.counted_backward_fused_(grad, weights, state1, state2, torch.zeros(()),
                                       int(optimizer), hparams, *lookup,
                                       torch.tensor(0.1, dtype=torch.float64))
    raise_pending_checks()  # (nothing ran: every count stays 0)


def gpu_check_rows() -> None:
    """Every Triton launch of the speed sections of ``benchmarks.gpu_check``, launch variants
    included, at the paper's dim and block sizes, 26 features, and a batch, id count and
    array size that Triton specialises as it does the paper's (multiples of 16; an array
    that is not): a variant that does not compile shows here, not in a GPU session."""
    from benchmarks import gpu_check, gpu_speed

    cards = [1000] * 25 + [1001]  # an array of 332,812 floats, as the paper's 4,321,609
    for per_bag, variants in ((1, gpu_check.ONE_ID_VARIANTS),
                              (gpu_check.IDS_PER_BAG, gpu_check.VARIANTS)):
        s = gpu_speed.Scenario("compiled", 32, 128, cards, per_bag, [32, 128], 10.0)
        lk = gpu_speed.Lookup(s, torch.device("cpu"))
        # checks deferred, as on a GPU: the backward kernels launch their guarded variants
        with gpu_speed.triton_path(lk.device), defer_checks(True):
            rows, _ = gpu_speed.scenario_rows(lk, {**variants, **gpu_check.ALWAYS},
                                              reference_reps=0)
            for row in rows:  # the others read what nothing launched here wrote
                if row.name.startswith(("ROBE-Z", "floor: L2")):
                    row.forward()
                    if row.train:
                        row.train()
        raise_pending_checks()
        print("scenario gpu_check speed rows,", per_bag, "id(s) a bag", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    global _target
    p = argparse.ArgumentParser(description="Compile every launched kernel variant.")
    p.add_argument("--arch", type=int, default=90, choices=sorted(MAX_SHARED),
                   help="compute capability to compile for (default 90, an H100)")
    _target = GPUTarget("cuda", p.parse_args(argv).arch, 32)
    assert not tk._is_interpreted(tk), "unset TRITON_INTERPRET: this compiles the kernels"
    jit.JITFunction.run = _compile_only
    tk._kernels_for = lambda device: tk  # CPU tensors stand in for CUDA ones: nothing runs
    variants = itertools.product(scenarios(), (HashMode.REFERENCE, HashMode.MIX),
                                 (False, True))
    for i, (shape, mode, weighted) in enumerate(variants):
        index_dtype = torch.int32 if i % 2 else torch.int64
        dtype = (torch.float32, torch.bfloat16, torch.float64, torch.float16)[i // 2 % 4]
        case = random_case(seed=i, hash_mode=int(mode), weighted=weighted,
                           index_dtype=index_dtype, dtype=dtype, **shape)
        label = (f"{shape} hash={mode.name.lower()} weighted={weighted} ids={index_dtype} "
                 f"weights={dtype}")
        try:
            run_ops(case)
        except Exception as exc:  # name the shape, then fail
            print(f"FAILED on {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
            raise
        print("scenario", label, flush=True)
    gpu_check_rows()
    kernels = list(_compiled.values())
    print(f"{len(kernels)} variants compiled for sm_{_target.arch}; at most "
          f"{max(k.metadata.shared for k in kernels)} bytes of shared memory and "
          f"{max(k.metadata.num_warps for k in kernels)} warps a program", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
