"""What does the host spend on one ROBE-Z op call on the Triton path, layer by layer?

A GPU forward with one id a bag is bound by its host, whose work is Python and torch, so the
calls run with every Triton launch stubbed (``triton_kernels.stubbed_launches``) on CPU
tensors (checks deferred as on CUDA) or, ``--cuda``, on a GPU, whose ``launched`` rows add the
launcher back. Rows, microseconds a call: the wrapper, also with the checks in the summary
kernel (``tuned(count_in_forward=False)``); the op without and with autograd, also on
multi-hot bags (one batch again, and a batch of another number of ids every call) and on
one-id bags of another batch size every call; its backward, the fused step (through the
ops, and calling the wrappers); a TorchRec user's training
forward through the module (where torchrec is installed); a second trip through the
dispatcher; the host's speed (a same-schema op returning its input, ``torch.add``, 1000
Python additions). Where Triton can compile for NVIDIA GPUs (no GPU needed), the
``launched`` rows run four of them with the launches made down to Triton's C launcher, which
a stand-in driver replaces (:mod:`robe_torchrec.testing.recorded_launches`): the cached
launch the ops use, and ``JITFunction.run``; two of them also with Triton's binder called at
every launch (the cached launch before its argument keys). The op's path (Triton kernels, deferred checks,
grad mode) is set once a sample, not at each call. Rows interleaved, 1 thread::

    python -m benchmarks.host_overhead --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import statistics
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from benchmarks.common import (command_line, header, interleaved, keep_freed_memory, parser,
                               publish, table)
from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops import cpu_backend, defer_checks, raise_pending_checks, triton_kernels
from robe_torchrec.ops.count_rows import zeroed_counts
from robe_torchrec.ops.meta import BoundsCheck, Optimizer, Pooling, build_table_meta
from robe_torchrec.ops.tuning import current as current_tuning, tuned

FEATURES, DIM, BLOCK_SIZE, MEMORY = 26, 128, 32, 65536
#: the rows on the op's path (:func:`on_path`), by whether they record the autograd graph
ON_PATH = {"wrapper": False, "wrapper, summary kernel": False, "op, no grad": False,
           "op, no grad, an answer copy each": False, "op, with grad": True,
           "op + backward": True, "fused step": False, "fused step, wrappers": False,
           "through the dispatcher twice": False,
           "op, no grad, multi-hot, one batch again": False,
           "op, no grad, multi-hot, a new batch each call": False,
           "op, no grad, a new batch size each call": False,
           "module forward, fused Adagrad, training": True}
#: the rows also timed with their launches made (by a stand-in driver)
LAUNCHED = ("wrapper", "op, no grad", "op + backward", "fused step")
#: launched rows also timed with Triton's binder called at every launch (no argument keys)
BOUND = ("op, no grad", "fused step")
#: rows timed with a tuning of their own (set for each sample, not each call)
ROW_TUNINGS = {"op, no grad, an answer copy each": {"answers_per_copy": 1}}
#: rows whose first calls raised, and why (left out of the run, named in the report)
LEFT_OUT: Dict[str, str] = {}
#: kept alive here: a library's registrations last as long as the object
_LIBRARIES: List[torch.library.Library] = []


def identity_op() -> Callable:
    """An op of ``robe::forward``'s schema whose kernel returns its first input (namespace
    ``robe_host_id``): the dispatcher's cost of such a call on this host."""
    if not hasattr(torch.ops.robe_host_id, "forward"):
        lib = torch.library.Library("robe_host_id", "DEF")
        _LIBRARIES.append(lib)
        lib.define(str(torch.ops.robe.forward.default._schema).split("::", 1)[1])
        for key in ("CPU", "CUDA"):
            lib.impl("forward", lambda first, *rest: first, key)
    return torch.ops.robe_host_id.forward


def calls(device: torch.device, batch: int) -> Dict[str, Callable[[], object]]:
    """One call of each row; a row on the op's path (named in :data:`ON_PATH`) runs on
    the Triton path with checks deferred, as on CUDA (:func:`on_path`)."""
    g = torch.Generator().manual_seed(0)
    cards = [100_000] * FEATURES
    ids = torch.randint(0, cards[0], (FEATURES * batch,), generator=g).to(device)
    offsets = torch.arange(ids.numel() + 1, device=device)
    meta = build_table_meta([DIM] * FEATURES, [0] * FEATURES, [MEMORY] * FEATURES,
                            [sum(cards[:t]) for t in range(FEATURES)], cards,
                            [int(Pooling.SUM)] * FEATURES, device=device)
    params = hash_params(HashMode.REFERENCE, seed=1024)
    flat = (ids, offsets, None, meta, DIM * FEATURES, BLOCK_SIZE, int(HashMode.REFERENCE),
            params, int(BoundsCheck.ERROR))
    weights = torch.empty(MEMORY, device=device).uniform_(-0.01, 0.01).requires_grad_(True)
    plain, state = weights.detach().clone(), torch.zeros(MEMORY, device=device)
    grad = torch.randn(batch, DIM * FEATURES, device=device)
    small = torch.ones(4, device=device)
    identity = identity_op()
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA if device.type == "cuda"
                                   else torch._C.DispatchKey.CPU)

    def summary():
        with tuned(count_in_forward=False):
            return triton_kernels.forward(plain, *flat)

    def backward():
        weights.grad = None
        torch.ops.robe.forward(weights, *flat).backward(grad)

    def fused_step(ops=torch.ops.robe):
        ops.forward(plain, *flat)
        ops.backward_fused_(grad, plain, state, state.new_empty(0), ids, offsets, None, meta,
                            BLOCK_SIZE, int(HashMode.REFERENCE), params,
                            int(Optimizer.ADAGRAD), [0.01, 1e-8, 0.9, 0.999, 0.0], 1)

    def twice():
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.robe.forward.default.redispatch(keys, plain, *flat)

    rows = {"wrapper": lambda: triton_kernels.forward(plain, *flat),
            "wrapper, summary kernel": summary,
            "op, no grad": lambda: torch.ops.robe.forward(weights, *flat),
            "op, no grad, an answer copy each": lambda: torch.ops.robe.forward(weights, *flat),
            "op, with grad": lambda: torch.ops.robe.forward(weights, *flat),
            "op + backward": backward, "fused step": fused_step,
            "fused step, wrappers": lambda: fused_step(triton_kernels),
            "through the dispatcher twice": twice}
    multi_hot = varied_batches(device, batch, num_rows=cards[0], multi_hot=True)
    new_batch = itertools.cycle(multi_hot)
    new_size = itertools.cycle(varied_batches(device, batch, num_rows=cards[0],
                                              multi_hot=False))
    rows["op, no grad, multi-hot, one batch again"] = \
        lambda: torch.ops.robe.forward(weights, *multi_hot[0], *flat[2:])
    rows["op, no grad, multi-hot, a new batch each call"] = \
        lambda: torch.ops.robe.forward(weights, *next(new_batch), *flat[2:])
    rows["op, no grad, a new batch size each call"] = \
        lambda: torch.ops.robe.forward(weights, *next(new_size), *flat[2:])
    module_forward = fused_module_forward(device, ids, batch)
    if module_forward is not None:
        rows["module forward, fused Adagrad, training"] = module_forward
    rows.update({"op of the same schema returning its input": lambda: identity(plain, *flat),
                 "torch.add of 4-element tensors": lambda: torch.add(small, small),
                 "pure Python: 1000 additions": lambda: sum(range(1000))})
    rows.update(forward_primitives(device, (batch, DIM * FEATURES)))
    return rows


def varied_batches(device: torch.device, batch: int, num_rows: int, multi_hot: bool,
                   count: int = 64) -> List[tuple]:
    """``count`` batches ``(values, offsets)`` of the tables (``num_rows`` rows each), each
    unlike the last: ``multi_hot``, ``batch`` bags of 0 to 4 ids, 2 on average, another
    number of ids in all each batch, as multi-hot features hold from one batch to the next;
    else bags of one id, a batch size drawn from ``[batch / 2, batch]`` each batch, as the
    padded batch of an unpooled lookup or of a variable batch per feature. 64 of them, twice
    the plans the ops keep for one ``table_meta``: a batch never finds one made for its own
    sizes still kept, as in training, where they seldom come back."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(count):
        if multi_hot:
            lengths = torch.randint(0, 5, (FEATURES * batch,), generator=g)
        else:
            size = int(torch.randint(batch // 2, batch + 1, (1,), generator=g))
            lengths = torch.ones(FEATURES * size, dtype=torch.int64)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        values = torch.randint(0, num_rows, (int(offsets[-1]),), generator=g)
        batches.append((values.to(device), offsets.to(device)))
    return batches


def fused_module_forward(device: torch.device, ids: torch.Tensor, batch: int
                         ) -> Optional[Callable[[], object]]:
    """A TorchRec user's training forward at the same setting: a
    ``RobeEmbeddingBagCollection`` of the 26 tables on one array, its optimizer fused into the
    backward (``apply_optimizer_in_backward``, Adagrad), called on a ``KeyedJaggedTensor``:
    the op plus the module's own work (the features' split, the fused lookup's autograd node,
    the ``KeyedTensor``). ``None`` where torchrec is not installed."""
    try:
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.optim import apply_optimizer_in_backward
    except ImportError:
        return None
    from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection

    names = [f"f{t}" for t in range(FEATURES)]
    tables = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=DIM, num_embeddings=100_000,
                                 feature_names=[name]) for t, name in enumerate(names)]
    module = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=MEMORY,
                                                           block_size=BLOCK_SIZE),
                                        device=device)
    apply_optimizer_in_backward(torch.optim.Adagrad, [module.weight], {"lr": 0.01})
    # offsets given with the lengths: the module reads them, and deriving them is an fbgemm
    # op that fbgemm-gpu-cpu (what a GPU machine of this project has) has no CUDA kernel for
    features = KeyedJaggedTensor(keys=names, values=ids,
                                 lengths=torch.ones(ids.numel(), dtype=torch.int64,
                                                    device=device),
                                 offsets=torch.arange(ids.numel() + 1, device=device))
    return lambda: module(features)


def forward_primitives(device: torch.device, out_shape: tuple) -> Dict[str, Callable[[], object]]:
    """The torch calls a forward makes on the device besides its kernel's launch, each on its
    own (rows named ``primitive: ...``): the output's allocation, the check counts' zeroed
    row (:mod:`~robe_torchrec.ops.count_rows`: a block's fill, on CUDA a launch, every 256
    rows), and, where the checks are deferred, the answers' copy to pinned memory with its
    event recorded and the event query of a later call, each once a copy, which carries the
    answers of ``answers_per_copy`` forwards (:mod:`~robe_torchrec.ops.answer_copies`; CUDA
    only: on CPU tensors nothing waits for a copy). What of a forward's host time is torch's
    own work, whatever the wrapper does."""
    rows = {"primitive: torch.empty of the output": lambda: torch.empty(out_shape, device=device),
            "primitive: the check counts' zeroed row": lambda: zeroed_counts(device)}
    if device.type == "cuda":
        per_copy = current_tuning().answers_per_copy
        counts = torch.zeros(per_copy, 4, dtype=torch.int64, device=device)
        pinned = torch.empty(per_copy, 4, dtype=torch.int64, pin_memory=True)
        event, copies, queries = torch.cuda.Event(), itertools.count(1), itertools.count(1)

        def copy_and_record():
            if next(copies) % per_copy == 0:
                pinned.copy_(counts, non_blocking=True)
                event.record()

        def query():
            if next(queries) % per_copy == 0:
                event.query()

        rows[f"primitive: answers to pinned memory, event recorded, 1 in {per_copy} calls"] = \
            copy_and_record
        rows[f"primitive: event query, 1 in {per_copy} calls"] = query
    return rows


#: samples a row between two writes of the partial report
ROUND_REPS = 10


def measure(rows: Dict[str, Callable[[], object]], reps: int, per_sample: int,
            sync: Callable[[], None],
            contexts: Optional[Dict[str, Callable[[], ContextManager]]] = None,
            after_round: Optional[Callable[[Dict[str, List[float]]], None]] = None,
            round_reps: int = 0) -> Dict[str, List[float]]:
    """``reps`` samples of each row (microseconds per call), rows interleaved; a row named in
    ``contexts`` runs each sample inside that context (its cost spread over the calls).
    ``after_round`` gets the samples so far after every ``round_reps`` of them but the last
    round (the caller reports the whole), so that a run stopped early leaves what it had
    measured."""
    contexts = contexts or {}
    for name, fn in list(rows.items()):  # warm-up: caches of checked metadata, first calls
        try:
            with contexts.get(name, contextlib.nullcontext)():
                for _ in range(3):
                    fn()
        except Exception as exc:  # noqa: BLE001  the row is left out, the report says why
            LEFT_OUT[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            del rows[name]
            print(f"row {name!r} left out: {LEFT_OUT[name]}", flush=True)

    def sample(name: str, fn: Callable[[], object]) -> Callable[[int], object]:
        def run(it: int) -> None:
            with contexts.get(name, contextlib.nullcontext)():
                for _ in range(per_sample):
                    fn()
        return run

    fns = {name: sample(name, fn) for name, fn in rows.items()}
    us: Dict[str, List[float]] = {name: [] for name in rows}
    # rounds of an even size: each keeps interleaved's alternating order
    step = reps if round_reps <= 0 else max(2, round_reps + round_reps % 2)
    done = 0
    while done < reps:
        gc.collect()
        gc.disable()  # as timeit: a collection would land on whichever call triggers it
        try:
            samples = interleaved(fns, min(step, reps - done), before=lambda name: sync())
        finally:
            gc.enable()
        done += min(step, reps - done)
        for name, v in samples.items():
            us[name] += [s / per_sample * 1e6 for s in v["wall"]]
        if after_round is not None and done < reps:
            after_round(us)
    sync()
    raise_pending_checks()
    return us


def op_floor(med: Dict[str, float]) -> Optional[Dict[str, float]]:
    """What any forward op doing this work through a Python kernel registered with
    ``torch.library`` spends on this host, whatever its wrapper does, from the medians: the
    dispatcher reaching a Python kernel (the same-schema op returning its input), the
    forward's device primitives, and the launch path (the launched wrapper less the stubbed
    one). ``None`` without launched rows."""
    if "wrapper, launched" not in med:
        return None
    return {"the dispatcher reaching a Python kernel":
            med["op of the same schema returning its input"],
            "the device primitives": sum(v for n, v in med.items()
                                         if n.startswith("primitive: ")),
            "the launch path": med["wrapper, launched"] - med["wrapper"]}


def _have(med: Dict[str, float], *names: str) -> bool:
    """Whether every row named was timed (a row whose first calls raised is left out)."""
    return all(name in med for name in names)


@contextlib.contextmanager
def on_path(device: torch.device, grad_mode: bool):
    """The op's path as a training loop sets it up once, not at each call: the Triton
    kernels (on CPU tensors, which would take the C++ ones), the checks deferred (as on
    CUDA), and the grad mode. Entered once a sample: the few us it takes to enter are no
    part of an op call."""
    triton = cpu_backend("triton") if device.type == "cpu" else contextlib.nullcontext()
    with triton, defer_checks(True), torch.set_grad_enabled(grad_mode):
        yield


def can_compile() -> bool:
    """Whether this process's Triton compiles for NVIDIA GPUs (no GPU needed)."""
    if triton_kernels.interpreted():
        return False
    import triton
    return "nvidia" in getattr(triton.backends, "backends", {})


@contextlib.contextmanager
def launching(on_cpu: bool, cached: bool):
    """The ops' launches made (``on_cpu``: on CPU tensors, for a stand-in driver), cached
    or through ``JITFunction.run``."""
    with (triton_kernels.launch_on_cpu_tensors() if on_cpu else contextlib.nullcontext()), \
            tuned(cached_launch=cached):
        yield


@contextlib.contextmanager
def bound_at_every_launch(on_cpu: bool):
    """Cached launches, but with Triton's binder specialising the arguments at every launch
    (as before the launches found their variant by :func:`~robe_torchrec.ops.triton_launch.
    argument_key`): what those keys save."""
    from robe_torchrec.ops import triton_launch

    key = triton_launch.argument_key
    triton_launch.argument_key = lambda args, constants: None
    try:
        with launching(on_cpu, cached=True):
            yield
    finally:
        triton_launch.argument_key = key


@contextlib.contextmanager
def _stubbed(tuning: dict):
    with triton_kernels.stubbed_launches(), tuned(**tuning):
        yield


@contextlib.contextmanager
def _within(path: Optional[Callable[[], ContextManager]], inner: Callable[[], ContextManager]):
    with (path() if path else contextlib.nullcontext()), inner():
        yield


def with_launched(rows: Dict[str, Callable[[], object]], device: torch.device, launched: bool):
    """``rows``, run with launches stubbed, and (``launched``) the :data:`LAUNCHED` ones
    again with their launches made, cached and through ``JITFunction.run``; with the context
    of each row (inside :func:`on_path` for the rows of :data:`ON_PATH`)."""
    cuda = device.type == "cuda"
    paths = {name: functools.partial(on_path, device, ON_PATH[name])
             for name in rows if name in ON_PATH}
    contexts = {name: functools.partial(_within, paths.get(name), functools.partial(
        _stubbed, ROW_TUNINGS.get(name, {}))) for name in rows}
    rows = dict(rows)
    for name in LAUNCHED if launched else ():
        for cached, suffix in ((True, "launched"), (False, "launched via JITFunction.run")):
            rows[f"{name}, {suffix}"] = rows[name]
            contexts[f"{name}, {suffix}"] = functools.partial(
                _within, paths[name], functools.partial(launching, not cuda, cached))
    for name in BOUND if launched else ():
        rows[f"{name}, launched, bound at every launch"] = rows[name]
        contexts[f"{name}, launched, bound at every launch"] = functools.partial(
            _within, paths[name], functools.partial(bound_at_every_launch, not cuda))
    return rows, contexts


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    p = parser("host_overhead", __doc__)
    p.add_argument("--cuda", action="store_true", help="CUDA tensors (default: CPU tensors)")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--reps", type=int, default=40, help="samples per row")
    p.add_argument("--calls", type=int, default=20, help="calls per sample")
    p.add_argument("--out", help="a folder (host_overhead.md) or a .md file; .json beside it")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.cuda else "cpu")
    sync = torch.cuda.synchronize if args.cuda else (lambda: None)
    keep_freed_memory()  # outputs reuse freed blocks, as a GPU's caching allocator does
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recorded = not args.cuda and can_compile()
        rows, contexts = with_launched(calls(device, args.batch), device,
                                       launched=args.cuda or recorded)
        recording = contextlib.nullcontext()
        if recorded:  # the first launch of a variant compiles it
            from robe_torchrec.testing.recorded_launches import recorded_launches
            recording = recorded_launches(keep=False)
        LEFT_OUT.clear()

        def partial(samples: Dict[str, List[float]]) -> None:
            report(samples, args, argv, device, partial=True)

        with recording:
            samples = measure(rows, args.reps, args.calls, sync, contexts,
                              after_round=partial if args.out else None,
                              round_reps=ROUND_REPS)
    finally:
        torch.set_num_threads(threads)
    return report(samples, args, argv, device, partial=False)


def report(samples: Dict[str, List[float]], args: argparse.Namespace,
           argv: Optional[Sequence[str]], device: torch.device,
           partial: bool) -> Dict[str, object]:
    """Write the report of ``samples`` to ``args.out`` (if any) and return its numbers;
    ``partial``: a round's, rewritten by the next (a run stopped early keeps it)."""
    med = {name: statistics.median(v) for name, v in samples.items()}
    low = {name: statistics.quantiles(v, n=4)[0] if len(v) > 1 else v[0]
           for name, v in samples.items()}
    lines = header("Host time of a ROBE-Z op call on the Triton path",
                   command_line("host_overhead", argv),
                   f"setting: {device.type} tensors, batch {args.batch}, {FEATURES} features of "
                   f"dim {DIM}, one id a bag, Z = {BLOCK_SIZE}, array {MEMORY:,} floats; checks "
                   f"deferred; 1 thread; {args.reps} samples of {args.calls} calls, interleaved")
    if partial:
        taken = min((len(v) for v in samples.values()), default=0)
        lines += [f"**Partial**: {taken} of {args.reps} samples a row so far (the run was "
                  "stopped, or is still running).", ""]
    lines += ["Microseconds per call: what the host of a GPU runs too, less Triton's launch "
              "path and the driver. The `launched` rows add the launch path: on CPU down to "
              "Triton's C launcher (a stand-in driver records each launch there), with "
              "`--cuda` the real launcher and driver. The op's path (the Triton kernels, "
              "checks deferred, the grad mode) is set once a sample, as a training loop sets "
              "it, not at each call.", ""]
    lines += table(["row", "median", "lower quartile"],
                   [[n, f"{med[n]:.1f}", f"{low[n]:.1f}"] for n in samples])
    ratios = {n: med[f"{n}, launched"] / med[f"{n}, launched via JITFunction.run"]
              for n in LAUNCHED
              if _have(med, f"{n}, launched", f"{n}, launched via JITFunction.run")}
    if ratios:
        lines += ["", "Launched cached / through `JITFunction.run` (medians): " + ", ".join(
            f"{n} {r:.2f}x" for n, r in ratios.items())]
    keyed = {n: med[f"{n}, launched"] / med[f"{n}, launched, bound at every launch"]
             for n in BOUND
             if _have(med, f"{n}, launched", f"{n}, launched, bound at every launch")}
    if keyed:
        lines += ["", "Launched, variants found by argument key / bound by Triton's binder at "
                  "every launch (medians): " + ", ".join(f"{n} {r:.2f}x"
                                                         for n, r in keyed.items())]
    one_each = "op, no grad, an answer copy each"
    per_copy = current_tuning().answers_per_copy
    if _have(med, "op, no grad", one_each):
        lines += ["", f"`op, no grad` (the answers of {per_copy} forwards a copy) / "
                  f"`{one_each}`: {med['op, no grad'] / med[one_each]:.2f}x (medians)."]
    again, new = ("op, no grad, multi-hot, one batch again",
                  "op, no grad, multi-hot, a new batch each call")
    if _have(med, again, new):
        lines += ["", f"Multi-hot bags, `{new}` / `{again}`: {med[new] / med[again]:.2f}x "
                  "(medians): what a batch holding another number of ids than the last costs "
                  "the host."]
    sized = "op, no grad, a new batch size each call"
    if _have(med, sized, "op, no grad"):
        lines += ["", f"One id a bag, `{sized}` / `op, no grad`: "
                  f"{med[sized] / med['op, no grad']:.2f}x (medians): what a batch of another "
                  "size than the last (an unpooled lookup's, a variable batch's) costs the host."]
    primitives = sum(v for n, v in med.items() if n.startswith("primitive: "))
    op = "op, no grad, launched" if "op, no grad, launched" in med else "op, no grad"
    if op in med:
        lines += ["", f"The forward's torch calls on the device besides its launch (the "
                  f"`primitive` rows, each its share of one forward; the event query is a "
                  f"later call's) add up to {primitives:.1f} us, {primitives / med[op]:.0%} of "
                  f"`{op}` ({med[op]:.1f} us)."]
    floor = op_floor(med) if _have(med, op, "op of the same schema returning its input",
                                   "wrapper") else None
    if floor:
        total = sum(floor.values())
        lines += ["", "A floor for a forward op on this host, whatever its wrapper does: "
                  + ", ".join(f"{part} {us:.1f} us" for part, us in floor.items())
                  + f", {total:.1f} us in all. `{op}` takes {med[op] / total:.2f}x that; the "
                  "rest is the Python of the wrapper and of the op's layers."]
    if LEFT_OUT:
        lines += ["", "Rows left out, their first calls having raised: " + "; ".join(
            f"`{name}` ({error})" for name, error in LEFT_OUT.items()) + "."]
    result = {"command": command_line("host_overhead", argv), "device": device.type,
              "batch": args.batch, "reps": args.reps, "calls": args.calls,
              "medians": med, "lower_quartiles": low, "cached_over_jit": ratios,
              "keyed_over_bound": keyed,
              "primitives_us": primitives, "floor_us": floor, "left_out": dict(LEFT_OUT),
              "samples_us": samples, "partial": partial}
    publish(args.out, "host_overhead", lines, result, echo=not partial)
    return result


if __name__ == "__main__":
    main()
