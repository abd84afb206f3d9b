"""Adversarial and random metadata for the ``robe`` ops, run in a child process.

``tests/ops/test_fuzz_cpu.py`` starts ``python -m tests.ops.fuzz_ops --backends ...`` so that a
crash (a signal) fails a test instead of killing pytest. The child prints one JSON line per
call: the case, the op, and how the call ended (``ok``, ``ValueError`` or another exception's
type). Before each call it writes the case's name to stderr, so a crash names its case.

Two kinds of case, both built from the small valid cases of :mod:`robe_torchrec.testing.op_cases`:

* **targeted** (``bad=True``): one named defect (an offset that makes ``OUT_OFFSET + DIM`` or
  ``W_OFFSET + W_SIZE`` wrap past 2**63, a negative size, an unknown enum, mismatched
  lengths, ...); every op must refuse it with a ``ValueError``.
* **random** (``bad=None``): one to three random mutations drawn from values near the int64
  limits, small negatives and powers of two, into random metadata fields, scalar arguments
  and offsets. The case may happen to be valid: the call must end in ``ok`` or ``ValueError``.

With ``--compare-reference`` the child also runs the pure-PyTorch reference forward on every
case and reports whether it ended the same way (ok vs ValueError). ``--asan`` loads the C++
kernels built with AddressSanitizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from robe_torchrec.ops import cpu_backend
from robe_torchrec.ops import meta as m
from robe_torchrec.ops.meta import Optimizer
from robe_torchrec.testing.op_cases import OpCase, case_matrix, random_case

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
OPS = ("forward", "backward_dense", "per_sample_weights_grad", "backward_fused_")
META_FIELDS = ("OUT_OFFSET", "DIM", "W_OFFSET", "W_SIZE", "ROW_OFFSET", "NUM_ROWS", "POOLING")


@dataclasses.dataclass
class Call:
    """One op call: the case's inputs plus the backward-only arguments."""

    case: OpCase
    grad_output: torch.Tensor
    state1: torch.Tensor
    state2: torch.Tensor
    optimizer: int = int(Optimizer.ADAGRAD)
    hparams: Tuple[float, ...] = (0.1, 1e-8, 0.9, 0.999, 0.0)
    step: int = 1

    def run(self, op: str):
        c = self.case
        fn = getattr(torch.ops.robe, op)
        if op == "forward":
            return fn(*c.forward_args())
        if op == "backward_dense":
            return fn(*c.backward_args(self.grad_output))
        if op == "per_sample_weights_grad":
            return fn(*c.psw_grad_args(self.grad_output))
        return fn(self.grad_output, c.weights, self.state1, self.state2, c.values, c.offsets,
                  c.per_sample_weights, c.table_meta, c.block_size, c.hash_mode,
                  list(c.hash_params), self.optimizer, list(self.hparams), self.step)


def base_call(seed: int) -> Call:
    """A small valid call (one of the contract cases, shrunk)."""
    kw = dict(case_matrix()[seed % 6])
    kw.update(seed=seed, batch=3, max_bag=3)
    case = random_case(**kw)
    acc = m.accumulation_dtype(case.weights.dtype)
    g = torch.Generator().manual_seed(seed)
    grad_output = torch.randn(case.batch, case.output_dim, generator=g, dtype=acc)
    state = torch.zeros(case.weights.numel(), dtype=acc)
    return Call(case, grad_output, state, state.clone())


def _set_meta(call: Call, field: str, t: int, value: int) -> None:
    call.case.table_meta = call.case.table_meta.clone()
    call.case.table_meta[getattr(m, field), t % call.case.table_meta.shape[1]] = value


def _set_offset(call: Call, pos: int, value: int) -> None:
    c = call.case
    info = torch.iinfo(c.offsets.dtype)
    c.offsets = c.offsets.clone()
    c.offsets[pos] = max(info.min, min(info.max, value))


# ---------------------------------------------------------------------------------------
# targeted cases: (name, mutate, ops that must refuse it)
# ---------------------------------------------------------------------------------------

Mutation = Callable[[Call], None]


def _wrap_out(call: Call) -> None:
    # OUT_OFFSET + DIM wraps to a negative number when summed in int64
    t = call.case.table_meta.shape[1] - 1
    _set_meta(call, "OUT_OFFSET", t, I64_MAX - int(call.case.table_meta[m.DIM, t]) + 2)


def _wrap_w(call: Call) -> None:
    _set_meta(call, "W_OFFSET", 0, I64_MAX - int(call.case.table_meta[m.W_SIZE, 0]) + 2)


def _field(field: str, value: int, t: int = 0) -> Mutation:
    return lambda call: _set_meta(call, field, t, value)


def _attr(name: str, value) -> Mutation:
    return lambda call: setattr(call.case, name, value)


def _call_attr(name: str, value) -> Mutation:
    return lambda call: setattr(call, name, value)


def _offset(pos: int, value: Callable[[Call], int]) -> Mutation:
    return lambda call: _set_offset(call, pos, value(call))


def _shape(name: str, fn: Callable[[torch.Tensor], torch.Tensor], on_call: bool = False) -> Mutation:
    def mutate(call: Call) -> None:
        owner = call if on_call else call.case
        setattr(owner, name, fn(getattr(owner, name)))
    return mutate


def _both(*mutations: Mutation) -> Mutation:
    def mutate(call: Call) -> None:
        for fn in mutations:
            fn(call)
    return mutate


ALL, FWD, BWD, FUSED = OPS, ("forward",), OPS[1:], ("backward_fused_",)

TARGETED: List[Tuple[str, Mutation, Tuple[str, ...]]] = [
    ("out_offset_plus_dim_wraps", _wrap_out, ALL),
    ("out_offset_max", _field("OUT_OFFSET", I64_MAX), ALL),
    ("dim_max", _field("DIM", I64_MAX, 1), ALL),
    ("w_offset_plus_w_size_wraps", _wrap_w, ALL),
    ("w_size_max", _field("W_SIZE", I64_MAX), ALL),
    ("w_offset_and_size_max", _both(_field("W_OFFSET", I64_MAX), _field("W_SIZE", I64_MAX)), ALL),
    ("w_offset_min", _field("W_OFFSET", I64_MIN), ALL),
    ("out_offset_negative", _field("OUT_OFFSET", -1, 1), ALL),
    ("dim_negative", _field("DIM", -1), ALL),
    ("dim_min", _field("DIM", I64_MIN), ALL),
    ("w_size_negative", _field("W_SIZE", -5), ALL),
    ("num_rows_negative", _field("NUM_ROWS", -1), ALL),
    ("pooling_7", _field("POOLING", 7), ALL),
    ("pooling_negative", _field("POOLING", -1, 1), ALL),
    ("meta_6_rows", _shape("table_meta", lambda t: t[:6]), ALL),
    ("meta_int32", _shape("table_meta", lambda t: t.int()), ALL),
    ("meta_no_features", _shape("table_meta", lambda t: t[:, :0]), ALL),
    ("output_dim_negative", _attr("output_dim", -1), FWD),
    ("output_dim_min", _attr("output_dim", I64_MIN), FWD),
    ("output_dim_max", _attr("output_dim", I64_MAX), FWD),
    ("output_dim_2_62", _attr("output_dim", 2**62), FWD),
    ("output_dim_too_small", lambda call: setattr(call.case, "output_dim", call.case.output_dim - 1), FWD),
    ("block_size_0", _attr("block_size", 0), ALL),
    ("block_size_negative", _attr("block_size", -3), ALL),
    ("block_size_min", _attr("block_size", I64_MIN), ALL),
    ("block_size_max", _attr("block_size", I64_MAX), ALL),
    ("hash_mode_7", _attr("hash_mode", 7), ALL),
    ("hash_mode_negative", _attr("hash_mode", -1), ALL),
    ("bounds_check_7", _attr("bounds_check", 7), FWD),
    ("bounds_check_negative", _attr("bounds_check", -1), FWD),
    ("hash_params_short", _attr("hash_params", [1, 2]), ALL),
    ("hash_params_long", _attr("hash_params", [1, 2, 3, 4]), ALL),
    ("offsets_last_past_values", _offset(-1, lambda c: c.case.values.numel() + 1), ALL),
    ("offsets_last_max", _offset(-1, lambda c: I64_MAX), ALL),
    ("offsets_first_nonzero", _offset(0, lambda c: 1), ALL),
    ("offsets_first_negative", _offset(0, lambda c: -1), ALL),
    ("offsets_middle_max", _offset(2, lambda c: I64_MAX), ALL),
    ("offsets_middle_min", _offset(2, lambda c: I64_MIN), ALL),
    ("offsets_middle_past_values", _offset(1, lambda c: c.case.values.numel() + 7), ALL),
    ("offsets_count_not_t_b_plus_1", _shape("offsets", lambda o: o[1:]), ALL),
    ("offsets_empty", _shape("offsets", lambda o: o[:0]), ALL),
    ("offsets_other_dtype", _shape("offsets", lambda o: o.int() if o.dtype == torch.int64 else o.long()), ALL),
    ("values_float", _shape("values", lambda v: v.float()), ALL),
    ("values_2d", _shape("values", lambda v: v[:, None]), ALL),
    ("weights_2d", _shape("weights", lambda w: w[:, None]), ALL),
    ("weights_int", _shape("weights", lambda w: w.long()), ALL),
    ("weights_empty", _shape("weights", lambda w: w[:0]), ALL),
    ("psw_short", _attr("per_sample_weights", torch.ones(1)), ("forward", "backward_dense", "backward_fused_")),
    ("id_past_num_rows", _shape("values", lambda v: torch.full_like(v, I64_MAX if v.dtype == torch.int64
                                                                   else 2**31 - 1)), FWD),
    ("id_negative", _shape("values", lambda v: torch.full_like(v, -1)), FWD),
    ("grad_output_rows", _shape("grad_output", lambda g: torch.cat([g, g[:1]]), on_call=True), BWD),
    ("grad_output_1d", _shape("grad_output", lambda g: g.reshape(-1), on_call=True), BWD),
    ("grad_output_narrow", _shape("grad_output", lambda g: g[:, :-1], on_call=True), BWD),
    ("optimizer_7", _call_attr("optimizer", 7), FUSED),
    ("optimizer_negative", _call_attr("optimizer", -1), FUSED),
    ("hparams_short", _call_attr("hparams", (0.1, 0.0)), FUSED),
    ("state1_short", _shape("state1", lambda s: s[:-1], on_call=True), FUSED),
    ("adam_step_0", _both(_call_attr("optimizer", int(Optimizer.ADAM)), _call_attr("step", 0)), FUSED),
]

# ---------------------------------------------------------------------------------------
# random cases
# ---------------------------------------------------------------------------------------


def _nasty_int(rng: random.Random, legit: int) -> int:
    return max(I64_MIN, min(I64_MAX, _nasty_unclamped(rng, legit)))


def _nasty_unclamped(rng: random.Random, legit: int) -> int:
    choice = rng.randrange(9)
    if choice == 0:
        return I64_MAX - rng.randrange(0, 64)
    if choice == 1:
        return I64_MIN + rng.randrange(0, 64)
    if choice == 2:
        return -rng.randrange(1, 64)
    if choice == 3:
        return rng.choice([2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**62, -(2**31), -(2**32)])
    if choice == 4:
        return rng.randrange(I64_MIN, I64_MAX)
    if choice == 5:
        return I64_MAX - legit + rng.randrange(-2, 3)  # near the wrap of a sum with legit
    return legit + rng.randrange(-3, 4)  # small off-by-few changes


def random_mutation(rng: random.Random) -> Mutation:
    kind = rng.randrange(4)
    if kind == 0:  # a table_meta entry
        field, t = rng.choice(META_FIELDS), rng.randrange(4)

        def mutate(call: Call) -> None:
            meta = call.case.table_meta
            _set_meta(call, field, t, _nasty_int(rng, int(meta[getattr(m, field), t % meta.shape[1]])))
        return mutate
    if kind == 1:  # an offset
        def mutate(call: Call) -> None:
            pos = rng.randrange(call.case.offsets.numel())
            _set_offset(call, pos, _nasty_int(rng, int(call.case.offsets[pos])))
        return mutate
    if kind == 2:  # a scalar argument
        name = rng.choice(["output_dim", "block_size", "hash_mode", "bounds_check"])

        def mutate(call: Call) -> None:
            value = _nasty_int(rng, getattr(call.case, name))
            if name == "output_dim" and 0 <= value < 2**40 and value > call.case.output_dim:
                value = call.case.output_dim + 1  # valid but wide: keep the allocation small
            setattr(call.case, name, value)
        return mutate
    # an id
    def mutate(call: Call) -> None:
        c = call.case
        if c.values.numel():
            info = torch.iinfo(c.values.dtype)
            c.values = c.values.clone()
            c.values[rng.randrange(c.values.numel())] = max(info.min, min(info.max, _nasty_int(rng, 0)))
    return mutate


# ---------------------------------------------------------------------------------------
# the child's loop
# ---------------------------------------------------------------------------------------


def _outcome(fn: Callable[[], object]) -> Tuple[str, str]:
    try:
        fn()
    except ValueError as exc:
        return "ValueError", str(exc).splitlines()[0][:300]
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
        return type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else ""
    return "ok", ""


def cases(seed: int, num_random: int) -> Iterator[Tuple[str, Call, Tuple[str, ...], Optional[bool]]]:
    """The targeted cases, then ``num_random`` random ones (both deterministic in ``seed``)."""
    for i, (name, mutate, ops) in enumerate(TARGETED):
        call = base_call(seed + i)
        mutate(call)
        yield name, call, ops, True
    rng = random.Random(seed)
    for i in range(num_random):
        call = base_call(seed + 1000 + i)
        for _ in range(rng.randint(1, 3)):
            random_mutation(rng)(call)
        yield f"random_{i}", call, OPS, None


def use_asan_build() -> None:
    """Build (or load) the C++ kernels with AddressSanitizer, in a build directory of their
    own: the flags are part of the default directory's key; an explicit
    ``$ROBE_TORCHREC_BUILD_DIR`` gets an ``-asan`` sibling. Refuses to run without libasan
    loaded, so the sanitizer cannot be silently absent."""
    import os

    from robe_torchrec.ops import cpu

    with open("/proc/self/maps", encoding="utf-8") as f:
        if "libasan" not in f.read():
            raise SystemExit("--asan needs libasan preloaded (LD_PRELOAD=$(g++ -print-file-name=libasan.so))")
    # -O0 compiles this file in a fraction of -O3's time, and ASan checks every access
    cpu.CFLAGS = [f for f in cpu.CFLAGS if not f.startswith("-O")] + [
        "-O0", "-fsanitize=address", "-fno-omit-frame-pointer"]
    cpu.LDFLAGS = cpu.LDFLAGS + ["-fsanitize=address"]
    if os.environ.get("ROBE_TORCHREC_BUILD_DIR"):
        os.environ["ROBE_TORCHREC_BUILD_DIR"] = os.environ["ROBE_TORCHREC_BUILD_DIR"].rstrip("/") + "-asan"
    print(json.dumps(dict(asan_build=cpu.build_directory())), flush=True)
    cpu.extension()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="cpp",
                        help="comma-separated, of cpp, reference, triton; all run the targeted "
                             "cases, the first also the random ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--random", type=int, default=200)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--compare-reference", action="store_true")
    parser.add_argument("--asan", action="store_true",
                        help="build the C++ kernels with AddressSanitizer (run this process "
                             "with libasan in LD_PRELOAD)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.asan:
        use_asan_build()
    wanted = set(args.ops.split(","))
    for i, backend in enumerate(args.backends.split(",")):
        for name, call, ops, bad in cases(args.seed, args.random if i == 0 else 0):
            for op in ops:
                if op not in wanted:
                    continue
                print(f"{backend} {name} {op}", file=sys.stderr, flush=True)
                with cpu_backend(backend):
                    outcome, message = _outcome(lambda: call.run(op))
                record = dict(backend=backend, case=name, op=op, bad=bad, outcome=outcome,
                              message=message)
                if args.compare_reference and op == "forward" and backend != "reference":
                    with cpu_backend("reference"):
                        record["reference"], record["reference_message"] = _outcome(
                        lambda: call.run(op))
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
