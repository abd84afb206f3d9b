"""Checks that need a CUDA device: the op matrix against the reference, no host
synchronisation in forward, backward and a fused step, and CUDA-graph capture and replay.

Run by ``tests/ops/test_gpu.py`` (skipped without a GPU) and by ``benchmarks.gpu_check``
(which needs no pytest). :func:`matrix_case` draws the random configurations; on CPU its
first few run in Triton's interpreter too (``tests/ops/test_triton_kernel.py``), so the
drawing code cannot rot.

Example::

    >>> for name, check in sync_and_graph_checks() + matrix_checks(40):
    ...     check()                      # raises AssertionError naming what differs
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import random
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from robe_torchrec.hashing import HashMode
from robe_torchrec.ops import count_rows, deferred_checks, raise_pending_checks
from robe_torchrec.ops import triton_kernels as tk
from robe_torchrec.ops.deferred_checks import DeferredCheckError, raise_ready
from robe_torchrec.ops.meta import NUM_ROWS, ROW_OFFSET, W_OFFSET, W_SIZE, BoundsCheck, Optimizer
from robe_torchrec.ops.tuning import tuned

from robe_torchrec.testing.op_cases import OpCase, random_case
from robe_torchrec.testing.op_checks import (OPTIMIZERS, check_backward_dense, check_forward, check_fused,
                     check_per_sample_weights_grad, fused_states)

DIMS = (1, 2, 3, 7, 16, 33, 64, 100, 128, 255, 256, 512)
BLOCK_SIZES = (1, 2, 3, 4, 8, 16, 31, 32, 64, 128, 256)
BAGS = (0, 1, 2, 3, 5, 20, 100, 500)
BATCHES = (1, 3, 7, 33, 64)
#: keep a case's reference (pure PyTorch, float64 on the CPU) to a second or so
MAX_ELEMENTS = 4_000_000


def matrix_case(seed: int) -> Tuple[str, OpCase]:
    """A random configuration (1 to 30 features, dims 1 to 512, Z 1 to 256, int32/int64 ids,
    sum and mean, per-sample weights or not, bags of 0 to 500 ids, either hash, batch 1 or
    odd) and a label that names it."""
    r = random.Random(seed)
    features = r.choice((1, 1, 2, 3, 5, 13, 26, 30))
    dims = [r.choice(DIMS) for _ in range(features)]
    block_size = r.choice(BLOCK_SIZES)
    batch = r.choice(BATCHES)
    max_bag = r.choice(BAGS)
    while features * batch * max(max_bag, 1) * max(dims) > MAX_ELEMENTS and max_bag > 1:
        max_bag //= 2
    kw = dict(seed=seed, dims=dims, batch=batch, max_bag=max_bag, block_size=block_size,
              hash_mode=int(r.choice(list(HashMode))), shared=r.random() < 0.5,
              weighted=r.random() < 0.4, pooling=[r.randint(0, 1) for _ in dims],
              index_dtype=r.choice((torch.int32, torch.int64)),
              memory_size=r.randint(block_size, 4 * block_size + 50_000),
              empty_fraction=r.choice((0.0, 0.2)))
    label = (f"T={features} dims={sorted(set(dims))} Z={block_size} B={batch} bag<={max_bag} "
             f"{HashMode(kw['hash_mode']).name.lower()} "
             f"{'weighted ' if kw['weighted'] else ''}{str(kw['index_dtype'])[6:]}")
    if not kw["shared"]:  # one array per feature: each must hold a block
        kw["memory_size"] = max(kw["memory_size"], (block_size + 13) * features)
    return label, random_case(**kw)


def check_adjoint(case: OpCase) -> None:
    """``<backward(g), w> = <forward(w), g>`` (the backward is the forward's transpose,
    whatever the hash), in float64 to keep rounding out of it."""
    case64 = OpCase(**{**case.__dict__, "weights": case.weights.double(),
                       "per_sample_weights": None if case.per_sample_weights is None
                       else case.per_sample_weights.double()})
    g = case.grad().double()
    lhs = (tk.backward_dense(*case64.backward_args(g)) * case64.weights).sum()
    rhs = (tk.forward(*case64.forward_args()) * g).sum()
    scale = float((tk.forward(*case64.forward_args()).abs() * g.abs()).sum()) or 1.0
    assert abs(float(lhs - rhs)) <= 1e-9 * scale, f"<Bg, w> = {float(lhs)}, <Fw, g> = {float(rhs)}"


def check_matrix_case(seed: int, device: str = "cuda") -> None:
    """Every op of one random configuration against the reference: forward, the dense
    gradient (with atomics, summed in a fixed order, and hashed in compact tiles), the
    per-sample-weight gradient, each fused optimizer, and the adjoint identity."""
    _, case = matrix_case(seed)
    case = case.to(device)
    check_forward(case)
    check_backward_dense(case)
    with tuned(deterministic_backward=True):
        check_backward_dense(case)
    with tuned(compact_hash=True, bags_per_program=8):
        check_forward(case)
        check_backward_dense(case)
    if case.per_sample_weights is not None:
        check_per_sample_weights_grad(case)
    check_adjoint(case)
    if case.values.numel():
        for name in OPTIMIZERS:
            check_fused(case, name, steps=1)
    raise_pending_checks()


# ---------------------------------------------------------------------------------------
# no host synchronisation, CUDA graphs
# ---------------------------------------------------------------------------------------

def _graph_case(device: str = "cuda", seed: int = 5) -> OpCase:
    """Two features, sum pooling, bags of up to 6 ids, per-sample weights of 1 and 2: with a
    gradient of small integers every sum is exact in float32, so the order of the atomic
    adds cannot change a bit and replays are compared bitwise (mean pooling would divide
    by the bag size and make the order matter)."""
    case = random_case(seed=seed, dims=[32, 64], batch=48, max_bag=6, block_size=16,
                       memory_size=1 << 14, weighted=True, pooling=[0, 0]).to(device)
    case.per_sample_weights = torch.randint(1, 3, case.values.shape,
                                            device=device).to(torch.float32)
    return case


def _integer_grad(case: OpCase, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (case.batch, case.output_dim), generator=g).float().cuda()


def _fused_step(case: OpCase, weights, state, grad, optimizer: Optimizer, hparams,
                step: Optional[torch.Tensor] = None, rate: Optional[torch.Tensor] = None):
    """One fused step: ``robe::backward_fused_`` at step 1, or, given a ``step`` tensor,
    ``robe::counted_backward_fused_`` advancing it (on the device: a capturable
    optimizer's count; on the CPU: torch.optim's default); ``rate``: the rate as the
    modules pass it, a tensor read in place of ``hparams[0]``."""
    lookup = (case.values, case.offsets, case.per_sample_weights, case.table_meta,
              case.block_size, case.hash_mode, case.hash_params)
    if step is None:
        torch.ops.robe.backward_fused_(grad, weights, *state, *lookup, int(optimizer), hparams,
                                       1, rate)
    else:
        torch.ops.robe.counted_backward_fused_(grad, weights, *state, step, int(optimizer),
                                               hparams, *lookup, rate)


def _training_step() -> Callable[[], None]:
    """A step of the ops as training calls them: a forward with autograd and its backward
    (dense and per-sample-weight gradients), then a forward and a fused Adagrad step; two
    forwards, each one deferred answer."""
    case = _graph_case()
    weights = case.weights.clone().requires_grad_(True)
    psw = case.per_sample_weights.clone().requires_grad_(True)
    optimizer, hparams = OPTIMIZERS["adagrad"]
    state = fused_states(case, optimizer)
    fused_weights = case.weights.clone()
    grad = _integer_grad(case, 0)

    def step():
        out = torch.ops.robe.forward(weights, case.values, case.offsets, psw,
                                     *case.forward_args()[4:])
        out.backward(grad)
        torch.ops.robe.forward(fused_weights, *case.forward_args()[1:])
        _fused_step(case, fused_weights, state, grad, optimizer, hparams)

    return step


def check_no_host_sync() -> None:
    """Forward with autograd, its dense backward, the per-sample-weight gradient and a fused
    step under ``torch.cuda.set_sync_debug_mode("error")``: nothing waits for the device
    (after a first call, which checks the static layout once)."""
    step = _training_step()
    step()
    with no_host_sync():
        for _ in range(3):
            step()
    raise_pending_checks()


def _sleep_cycles(ms: float) -> int:
    """The cycles ``torch.cuda._sleep`` takes to hold the current stream about ``ms``."""
    torch.cuda._sleep(1000)  # loads the sleep kernel
    calibration = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(calibration)
    end.record()
    end.synchronize()
    return int(calibration * ms / max(start.elapsed_time(end), 1e-3))


def check_host_runs_ahead(steps: int = 6, sleep_ms: float = 500.0) -> None:
    """While the device is held by a sleep kernel queued first (``sleep_ms``), the host
    issues ``steps`` training steps (:func:`_training_step`) and the device is still asleep
    when the last returns: no call waited for the device in any way, including those
    ``set_sync_debug_mode`` does not report (an event's ``synchronize``, a pinned
    allocation that waits, a copy that does). The host may run up to
    ``deferred_checks.MAX_PENDING`` forwards ahead before it waits for the oldest answer:
    ``steps`` keeps below that (two forwards a step)."""
    from robe_torchrec.ops.deferred_checks import MAX_PENDING

    assert 2 * steps < MAX_PENDING, (steps, MAX_PENDING)
    step = _training_step()
    for _ in range(steps):  # warm: plans, count rows, answer copies, the allocator's blocks
        step()
    raise_pending_checks()
    cycles = _sleep_cycles(sleep_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - began) * 1e3
    still_asleep = not end.query()
    torch.cuda.synchronize()
    raise_pending_checks()
    slept_ms = start.elapsed_time(end)
    assert still_asleep, (
        f"the device ended a {slept_ms:.0f} ms sleep before the host had issued {steps} "
        f"training steps ({host_ms:.1f} ms): some call waited for the device"
        + ("" if host_ms < 0.5 * slept_ms else " (or the host is that slow: inconclusive)"))


def check_unpooled_no_host_sync(device: str = "cuda") -> None:
    """The unpooled lookup (``robe_torchrec/ops/unpooled.py``, what
    ``RobeEmbeddingCollection`` runs) of three features holding different numbers of ids,
    forward and backward, under ``torch.cuda.set_sync_debug_mode("error")``, in each of its
    layouts: padded (features on arrays of their own), one feature of keys with the ids
    checked on the device, and one feature of keys with nothing to check (mix hash, raw
    ids). Its per-call index tensors are built without a wait for the device, and its rows
    are those of the CPU reference; an id outside its feature, a valid key of a later
    table's, is refused by the deferred check with the id's own message. Runs on CPU tensors
    too (without the sync mode; the ids are then checked at the call)."""
    from robe_torchrec.ops import cpu_backend
    from robe_torchrec.ops.args import LayoutArgs
    from robe_torchrec.ops.unpooled import robe_unpooled_lookup, unpooled_args

    on = torch.device(device)
    case = random_case(seed=7, dims=[16, 16, 16], batch=1, memory_size=1 << 12,
                       pooling=[0, 0, 0])
    counts = [5, 0, 3]
    values = torch.cat([torch.randint(0, int(case.table_meta[NUM_ROWS, f]), (n,),
                                      generator=torch.Generator().manual_seed(f))
                        for f, n in enumerate(counts)])
    keys_meta = case.table_meta.clone()
    keys_meta[W_OFFSET], keys_meta[W_SIZE] = 0, case.weights.numel()
    keys_meta[ROW_OFFSET] = keys_meta[NUM_ROWS].cumsum(0) - keys_meta[NUM_ROWS]
    padded_meta = keys_meta.clone()
    padded_meta[W_OFFSET], padded_meta[W_SIZE] = torch.arange(3), case.weights.numel() - 2
    checked = LayoutArgs(keys_meta, case.output_dim, case.block_size, int(HashMode.REFERENCE),
                         case.hash_params, int(BoundsCheck.ERROR))
    layouts = ((checked._replace(table_meta=padded_meta), True), (checked, False),
               (checked._replace(hash_mode=int(HashMode.MIX),
                                 bounds_check=int(BoundsCheck.UNBOUNDED)), False))
    for layout, gathers in layouts:
        with torch.no_grad(), cpu_backend("reference"):
            want = robe_unpooled_lookup(case.weights.double(), values, counts, layout)
        weights = case.weights.to(on).requires_grad_(True)
        lookup = (values.to(on), counts, layout._replace(table_meta=layout.table_meta.to(on)))
        assert (unpooled_args(*lookup)[1] is not None) == gathers, "the layout taken"
        robe_unpooled_lookup(weights, *lookup).sum().backward()  # checks the layout once
        weights.grad = None
        with no_host_sync() if on.type == "cuda" else contextlib.nullcontext():
            rows = robe_unpooled_lookup(weights, *lookup)
            rows.sum().backward()
        raise_pending_checks()
        torch.testing.assert_close(rows.detach().double().cpu(), want)
        assert weights.grad is not None and bool(weights.grad.abs().sum() > 0)
    # feature 0's first id one past its rows: a key of feature 1's table
    bad = values.clone()
    bad[0] = int(keys_meta[NUM_ROWS, 0])
    bad_layout = checked._replace(table_meta=keys_meta.to(on))
    on_device = case.weights.to(on)  # (a copy from pageable memory waits: not in the block)
    # a layout's first call reads it on the host (once per table_meta): not in the block
    robe_unpooled_lookup(on_device, values.to(on), counts, bad_layout)
    raise_pending_checks()
    lookup = (bad.to(on), counts, bad_layout)
    try:
        with _eager_calls_as_without_graph_trees():  # the message names the id
            with no_host_sync() if on.type == "cuda" else contextlib.nullcontext():
                robe_unpooled_lookup(on_device, *lookup)
            raise_pending_checks()
    except ValueError as err:  # DeferredCheckError on CUDA, at the call on CPU
        assert str(err).startswith(f"robe: id {int(bad[0])} at position 0 of feature 0 is "
                                   "out of range"), err
    else:
        raise AssertionError("an id outside its feature was not refused")


@contextlib.contextmanager
def _eager_calls_as_without_graph_trees():
    """Inside the block, the ops keep their inputs to name a problem even where this
    process has loaded Inductor's CUDA graph trees (a ``torch.compile`` check or test that
    ran earlier), whose pools may claim them
    (:func:`robe_torchrec.ops.long_lived.pools_may_claim`): the checks in the block make
    eager calls only, and assert the names."""
    original = deferred_checks.pools_may_claim
    deferred_checks.pools_may_claim = lambda device: False
    try:
        yield
    finally:
        deferred_checks.pools_may_claim = original


def _without_graph_trees(check: Callable[[], None]) -> Callable[[], None]:
    """``check`` run as in a process that has not loaded Inductor's CUDA graph trees (see
    :func:`_eager_calls_as_without_graph_trees`): for the checks of ``torch.cuda.graph``
    captures, which assert what a capture keeps to name a replay's problem."""
    def run() -> None:
        with _eager_calls_as_without_graph_trees():
            check()
    return run


def check_count_rows_on_streams() -> None:
    """The check counts' zeroed rows (``robe_torchrec/ops/count_rows.py``) on CUDA: forwards
    on the current stream and on a side stream, more of them than a block of rows holds,
    each take a fresh row of their own stream's block. Clean batches are never reported, a
    bad one on the side stream is reported and named, and the clean batches after it are
    clean again: a row handed out twice, not zero, or zeroed after its kernel would show as
    a false report or a missed one. The bad batch's kernel runs late (a sleep before it on
    the side stream) and nothing but the answer's own copy and event orders the host's read
    after it: a copy queued on another stream would read its counts before they are
    written, and miss the problem."""
    case = _graph_case()
    args = case.forward_args()
    bad_values = case.values.clone()
    bad_values[-1] = 10**9
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def forwards(count: int) -> None:
        with torch.no_grad(), _eager_calls_as_without_graph_trees():
            for _ in range(count):
                torch.ops.robe.forward(*args)
                with torch.cuda.stream(side):
                    torch.ops.robe.forward(*args)
        torch.cuda.current_stream().wait_stream(side)

    forwards(count_rows.ROWS_PER_BLOCK + 8)
    raise_pending_checks()
    cycles = _sleep_cycles(50.0)
    with torch.no_grad(), torch.cuda.stream(side), _eager_calls_as_without_graph_trees():
        torch.cuda._sleep(cycles)
        torch.ops.robe.forward(args[0], bad_values, *args[2:])
    assert _raised(raise_pending_checks, "id 1000000000 at position"), \
        "a bad batch on a side stream was not reported"
    torch.cuda.current_stream().wait_stream(side)
    forwards(count_rows.ROWS_PER_BLOCK)
    raise_pending_checks()


def check_answers_copied_together(device: str = "cuda") -> None:
    """Deferred answers carried four to a copy (``robe_torchrec/ops/answer_copies.py``): a
    bad forward's problem is not read before the copy carrying it goes out, even once the
    device has finished; after the fourth forward, a later call reads it without waiting and
    names it; a wait for every answer sends a copy not yet full. Runs on CPU tensors too
    (the Triton path in its interpreter, checks deferred), where the copy has no event."""
    on = torch.device(device)
    case = _graph_case(device)
    args = case.forward_args()
    bad_values = case.values.clone()
    bad_values[-1] = 10**9
    sync = torch.cuda.synchronize if on.type == "cuda" else (lambda: None)
    forward = torch.ops.robe.forward
    with torch.no_grad(), tuned(answers_per_copy=4), _eager_calls_as_without_graph_trees():
        raise_pending_checks()
        # start a block of rows: its last row would send a copy before it is full
        block_end = count_rows.ROWS_PER_BLOCK - 1
        while count_rows.position(count_rows.zeroed_counts(on))[1] != block_end:
            pass
        forward(args[0], bad_values, *args[2:])
        forward(*args)
        forward(*args)
        sync()
        raise_ready()  # raises if an answer was read before its copy went out
        forward(*args)
        sync()
        assert _raised(raise_ready, "id 1000000000 at position"), \
            "a full copy's answer was not read by a later call"
        forward(args[0], bad_values, *args[2:])
        assert _raised(raise_pending_checks, "id 1000000000 at position"), \
            "waiting for every answer did not send a copy not yet full"


@contextlib.contextmanager
def no_host_sync():
    """Inside the block, anything that makes the host wait for the device raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _capture(fn: Callable[[], object]) -> Tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` up on a side stream (as torch.cuda.graph's docs ask), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def check_graph_forward() -> None:
    """A captured forward replays bitwise equal to eager, on new ids copied into the
    static inputs."""
    case = _graph_case()
    static_values = case.values.clone()
    args = list(case.forward_args())

    def forward():
        return torch.ops.robe.forward(case.weights, static_values, *args[2:])

    graph, out = _capture(forward)
    fewest_rows = int(case.table_meta[NUM_ROWS].min())
    for seed in (11, 12):
        # new ids, the same bag lengths (the static offsets stay valid)
        g = torch.Generator().manual_seed(seed)
        new_values = torch.randint(0, fewest_rows, static_values.shape, generator=g)
        new_values = new_values.to(static_values)
        static_values.copy_(new_values)
        graph.replay()
        expected = torch.ops.robe.forward(case.weights, new_values.clone(), *args[2:])
        assert torch.equal(out, expected), "graph replay differs from eager"
    raise_pending_checks()


#: the rates a scheduler writes between the replays of the graph checks
_NEW_RATES = (0.02, 0.0, 0.5)


@dataclasses.dataclass
class _FusedRun:
    """The tensors one run of a graph check writes: its own copy of the case's weights (the
    ids are the case's, shared), the optimizer state and, for a counted run, the step
    count on the device (a capturable optimizer's)."""
    case: OpCase
    state: List[torch.Tensor]
    step: Optional[torch.Tensor]

    @classmethod
    def of(cls, case: OpCase, optimizer: Optimizer, counted: bool) -> "_FusedRun":
        device = case.weights.device
        return cls(OpCase(**{**case.__dict__, "weights": case.weights.clone()}),
                   fused_states(case, optimizer),
                   torch.zeros((), device=device) if counted else None)

    def take_step(self, grad: torch.Tensor, optimizer: Optimizer, hparams,
                  rate: Optional[torch.Tensor] = None) -> None:
        """Forward (whose input checks the backward reuses), then the fused step."""
        torch.ops.robe.forward(self.case.weights, *self.case.forward_args()[1:])
        _fused_step(self.case, self.case.weights, self.state, grad, optimizer, hparams,
                    self.step, rate)

    def written(self) -> List[Tuple[str, torch.Tensor]]:
        named = [("weights", self.case.weights), ("state1", self.state[0]),
                 ("state2", self.state[1])]
        return named + ([("step", self.step)] if self.step is not None else [])


def _replays_equal_eager(name: str, case: OpCase, optimizer: Optimizer, hparams,
                         counted: bool, rates: Optional[Sequence[float]] = None
                         ) -> Tuple[torch.cuda.CUDAGraph, _FusedRun]:
    """Capture a forward and fused step on one copy of ``case``, take the same steps
    eagerly on another, and check that three replays on new gradients leave every tensor
    bitwise equal to eager's. With ``rates``, the graph reads its rate from a tensor (as
    the modules pass it), set to ``rates[k]`` before replay ``k``; eager takes each as a
    float. Returns the graph and its run."""
    static_grad = _integer_grad(case, 0)
    graphed = _FusedRun.of(case, optimizer, counted)
    eager = _FusedRun.of(case, optimizer, counted)
    rate, graph_hparams = None, hparams
    if rates is not None:
        rate = torch.tensor(hparams[0], dtype=torch.float64, device=case.weights.device)
        graph_hparams = [math.nan] + list(hparams[1:])  # a replay that read it spoils all
    graph, _ = _capture(lambda: graphed.take_step(static_grad, optimizer, graph_hparams, rate))
    eager.take_step(static_grad, optimizer, hparams)  # as the warm-up inside _capture
    for k, seed in enumerate((1, 2, 3)):
        static_grad.copy_(_integer_grad(case, seed))
        step_hparams = hparams
        if rate is not None:
            rate.fill_(rates[k])
            step_hparams = [rates[k]] + list(hparams[1:])
        graph.replay()
        eager.take_step(static_grad, optimizer, step_hparams)
        for (what, a), (_, b) in zip(graphed.written(), eager.written()):
            assert torch.equal(a, b), f"{name}: {what} after replay {seed} differs from eager"
    raise_pending_checks()
    return graph, graphed


def check_graph_fused_backward() -> None:
    """Forward and fused backward (SGD, Adagrad, row-wise Adagrad) captured together replay
    bitwise equal to eager over three steps, with the step an int and counted on the device
    (as a module's Adagrad counts it: each replay advances it), and with the rate a float
    and a tensor written before each replay (as a scheduler writes the modules'); bad ids
    copied in before a replay change no weight and raise from :func:`raise_pending_checks`,
    and from :func:`raise_ready` (no wait) when a clean replay followed the bad one."""
    for name, counted, rates in itertools.product(("sgd", "adagrad", "rowwise_adagrad"),
                                                  (False, True), (None, _NEW_RATES)):
        optimizer, hparams = OPTIMIZERS[name]
        case = _graph_case()
        graph, graphed = _replays_equal_eager(name, case, optimizer, hparams, counted, rates)
        assert not counted or float(graphed.step) == 4, (
            f"{name}: the warm-up and 3 replays counted {float(graphed.step)} steps")
        graphed_w = graphed.case.weights
        kept = graphed_w.clone()
        case.values[-1] = 10**9  # out of range: the replay's forward counts it
        graph.replay()
        assert torch.equal(graphed_w, kept), f"{name}: a replay on bad ids changed weights"
        assert _raised(raise_pending_checks, "1000000000"), (
            f"{name}: the graph's bad ids were not reported")
        case.values[-1] = 0
        graph.replay()
        raise_pending_checks()  # the next good replay reads clean again
        # a bad replay that a clean one followed: only the replays' tally still holds it,
        # and a glance at its pinned copy (no wait) raises it
        case.values[-1] = 10**9
        graph.replay()
        case.values[-1] = 0
        graph.replay()
        torch.cuda.synchronize()
        assert _raised(raise_ready, "CUDA graph replays"), (
            f"{name}: a bad replay that a clean one followed was not reported")
        raise_pending_checks()


def _raised(read: Callable[[], None], text: str) -> bool:
    """Whether ``read()`` raises a :class:`DeferredCheckError` whose message holds ``text``."""
    try:
        read()
    except DeferredCheckError as exc:
        return text in str(exc)
    return False


def check_graph_capturable_adam() -> None:
    """Forward and fused Adam with its step on the device (``capturable=True``) captured
    together: each of three replays takes the next step, bitwise equal to eager calls
    (weights, both moments and the step count), with the rate a float and a tensor written
    before each replay."""
    optimizer, hparams = OPTIMIZERS["adam"]
    for rates in (None, _NEW_RATES):
        _, graphed = _replays_equal_eager("capturable adam", _graph_case(), optimizer,
                                          hparams, counted=True, rates=rates)
        assert graphed.step is not None and float(graphed.step) == 4, (
            f"the warm-up and 3 replays counted {float(graphed.step)} steps")


def check_dense_capturable_adam() -> None:
    """The data-parallel update (:func:`~robe_torchrec.ops.dense_update.apply_dense_update_`)
    with the step on the device: three steps bitwise equal to
    ``torch.optim.Adam(capturable=True, foreach=False)``, and no host synchronisation
    (the count is never read on the host). Needs torchrec (row-wise Adagrad's step)."""
    from robe_torchrec.ops.dense_update import apply_dense_update_

    g = torch.Generator().manual_seed(0)
    weights = torch.randn(1000, generator=g).cuda()
    grads = [torch.randn(1000, generator=g).cuda() for _ in range(3)]
    optimizer, hparams = OPTIMIZERS["adam"]
    lr, eps, beta1, beta2, weight_decay = hparams
    param = weights.clone().requires_grad_(True)
    stock = torch.optim.Adam([param], lr=lr, betas=(beta1, beta2), eps=eps,
                             weight_decay=weight_decay, capturable=True, foreach=False)
    ours, state = weights.clone(), [torch.zeros_like(weights), torch.zeros_like(weights)]
    step = torch.zeros((), device="cuda")
    for grad in grads:
        param.grad = grad.clone()
        stock.step()
        step += 1
        with no_host_sync():
            apply_dense_update_(ours, grad, *state, int(optimizer), hparams, step)
    assert torch.equal(ours, param.detach()), "the dense capturable Adam differs from torch's"
    assert torch.equal(state[0], stock.state[param]["exp_avg"])
    assert torch.equal(state[1], stock.state[param]["exp_avg_sq"])


def check_graph_refuses_adam() -> None:
    """Fused Adam with its step on the host (an int, or torch.optim's CPU step tensor) is
    refused under capture, pointing at ``capturable=True``."""
    case = _graph_case()
    optimizer, hparams = OPTIMIZERS["adam"]
    state = fused_states(case, optimizer)
    grad = _integer_grad(case, 0)
    weights = case.weights.clone()
    _fused_step(case, weights, state, grad, optimizer, hparams)  # warm
    for host_step in (None, torch.zeros(())):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                _fused_step(case, weights, state, grad, optimizer, hparams, host_step)
            refused = False
        except ValueError as exc:
            refused = "Adam cannot be captured" in str(exc) and "capturable=True" in str(exc)
        assert refused, f"fused Adam was captured with a frozen step (step={host_step})"


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` inside the block (ops without a
    deterministic kernel warn instead of raising: the check is about the bits)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def check_deterministic_backward() -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` the dense gradient and a fused
    Adagrad step of a case where blocks collide everywhere (about 0.7M (id, block) pairs on
    4,096 floats) give the same bits three times over, the host never waiting for the
    device; the atomic kernels' runs are compared too, for the record."""
    case = random_case(seed=11, dims=[128, 64], batch=4096, max_bag=60, block_size=32,
                       memory_size=4096, weighted=True, empty_fraction=0.0).to("cuda")
    grad = case.grad()
    optimizer, hparams = OPTIMIZERS["adagrad"]

    def runs():
        dense = [torch.ops.robe.backward_dense(*case.backward_args(grad)) for _ in range(3)]
        fused = []
        for _ in range(3):
            weights, state = case.weights.clone(), fused_states(case, optimizer)
            _fused_step(case, weights, state, grad, optimizer, hparams)
            fused.append(weights)
        return dense, fused

    atomic_dense, _ = runs()
    with deterministic_algorithms():
        dense, fused = runs()
        with no_host_sync():
            dense.append(torch.ops.robe.backward_dense(*case.backward_args(grad)))
    raise_pending_checks()
    differ = not all(torch.equal(atomic_dense[0], d) for d in atomic_dense[1:])
    print(f"    atomic backward runs differ: {differ}", flush=True)
    assert all(torch.equal(dense[0], d) for d in dense[1:]), "ordered gradients differ"
    assert all(torch.equal(fused[0], w) for w in fused[1:]), "ordered fused steps differ"
    torch.testing.assert_close(dense[0], atomic_dense[0], rtol=1e-4, atol=1e-2)


def check_cached_launches() -> None:
    """The ops launched cached (the default) and through ``JITFunction.run`` give the same
    bits: forward, the gradient summed in a fixed order, a fused Adagrad step; once every
    variant is compiled, no cached launch goes through ``JITFunction.run``."""
    from unittest import mock

    from triton.runtime.jit import JITFunction

    case = _graph_case()
    grad = _integer_grad(case, seed=3)
    optimizer, hparams = OPTIMIZERS["adagrad"]

    def ops():
        # every answer read first: each call's backward then takes the same variants (a
        # forward's answer sent early, with the last row of a block, would not guard it)
        raise_pending_checks()
        weights, state = case.weights.clone(), fused_states(case, optimizer)
        _fused_step(case, weights, state, grad, optimizer, hparams)
        with tuned(deterministic_backward=True):
            dense = torch.ops.robe.backward_dense(*case.backward_args(grad))
        return [torch.ops.robe.forward(*case.forward_args()), dense, weights, *state]

    with tuned(cached_launch=False):
        want = ops()
    ops()  # remembers the variants
    jit_runs = []
    original = JITFunction.run

    def counted(fn, *args, **kwargs):
        jit_runs.append(fn.fn.__name__)
        return original(fn, *args, **kwargs)

    with mock.patch.object(JITFunction, "run", counted):
        got = ops()
    raise_pending_checks()
    assert not jit_runs, f"cached launches went through JITFunction.run: {jit_runs}"
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"output {i} differs between cached and JIT launches"


def check_long_lived_outside_pools() -> None:
    """A tensor the ops keep across calls (``robe_torchrec/ops/long_lived.py``), first made
    while the calling thread allocates to a CUDA graph memory pool, as Inductor's CUDA
    graph trees' warm-up does, is not in that pool (which would hand its memory to a later
    graph), and holds what was made; a plain allocation there is in the pool (the
    control)."""
    from robe_torchrec.ops.long_lived import long_lived

    device = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        kept = long_lived(lambda: torch.arange(4096, device=device), device)
        control = torch.empty(4096, device=device)
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]

    def in_pool(tensor: torch.Tensor) -> bool:
        return any(start <= tensor.data_ptr() < end for start, end in segments)

    assert in_pool(control), "the control: an allocation inside use_mem_pool is in the pool"
    assert not in_pool(kept), "a kept tensor was made in the caller's CUDA graph pool"
    assert torch.equal(kept.cpu(), torch.arange(4096))
    del control


def matrix_checks(matrix: int) -> List[Tuple[str, Callable[[], None]]]:
    """``(name, check)`` of ``matrix`` random configurations against the CPU reference."""
    return [(f"matrix[{seed}: {matrix_case(seed)[0]}]", lambda s=seed: check_matrix_case(s))
            for seed in range(matrix)]


def check_compiled_op_reduce_overhead(steps: int = 4) -> None:
    """``robe::forward`` and its backward under ``torch.compile(mode="reduce-overhead")``
    (Inductor's CUDA graph trees: a warm-up, a recording, then replays) give eager's output
    and gradient bitwise at every step, and the trees' own check that nothing keeps their
    pool's memory past a warm-up or a recording (``slow_path_cudagraph_asserts``, on by
    default) passes; a graph run without a CUDA graph fails it. ``table_meta`` is a buffer
    of the compiled module, as in the ROBE modules: Dynamo marks it static, so the trees
    record on it rather than on a copy, which the op would first see inside the capture.
    Needs no torchrec."""
    import torch._inductor.config as inductor_config

    case = _graph_case()
    lookup = _BufferedLookup(case)
    compiled = torch.compile(lookup, mode="reduce-overhead")
    eager_weights = case.weights.clone().requires_grad_(True)
    compiled_weights = case.weights.clone().requires_grad_(True)
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        for k in range(steps):
            grad = _integer_grad(case, k)
            want = lookup(eager_weights)
            want.backward(grad)
            got = compiled(compiled_weights)
            assert torch.equal(got, want), f"step {k}: the compiled forward differs from eager"
            got.backward(grad)
            assert torch.equal(compiled_weights.grad, eager_weights.grad), (
                f"step {k}: the compiled gradient differs from eager")
            eager_weights.grad = compiled_weights.grad = None
    raise_pending_checks()


class _BufferedLookup(torch.nn.Module):
    """``robe::forward`` of a case's inputs on the weights it is called with, its
    ``table_meta`` a buffer (as a ROBE module holds it) and its ids and offsets inputs of
    the graph (as a KJT's are)."""

    def __init__(self, case: OpCase):
        super().__init__()
        values, offsets, psw, table_meta, *rest = case.forward_args()[1:]
        self.register_buffer("table_meta", table_meta)
        self._ids, self._rest = (values, offsets, psw), rest

    def forward(self, weights: torch.Tensor) -> torch.Tensor:
        values, offsets, psw = self._ids
        return torch.ops.robe.forward(weights, values, offsets, psw, self.table_meta,
                                      *self._rest)


def compiled_checks() -> List[Tuple[str, Callable[[], None]]]:
    """The checks of the ops under ``torch.compile`` with CUDA graphs that need no
    torchrec (after :func:`sync_and_graph_checks`: they load Inductor's CUDA graph trees)."""
    return [("compiled_op_reduce_overhead", check_compiled_op_reduce_overhead)]


def sync_and_graph_checks() -> List[Tuple[str, Callable[[], None]]]:
    """``(name, check)`` of the checks of host synchronisation, count rows, answer copies,
    CUDA graphs and launches. Best run before anything compiles with ``torch.compile``:
    ``torch._dynamo.reset()`` imports Inductor's CUDA graph trees where CUDA is present,
    after which the ops keep no input of a deferred check for the rest of the process
    (:func:`robe_torchrec.ops.long_lived.pools_may_claim`): the checks that assert a
    problem's name lift that for their eager calls
    (``_eager_calls_as_without_graph_trees``), and the checks of ``torch.cuda.graph``
    captures run as in a process without the trees (:func:`_without_graph_trees`)."""
    return [("no_host_sync", check_no_host_sync),
               ("host_runs_ahead", check_host_runs_ahead),
               ("unpooled_no_host_sync", check_unpooled_no_host_sync),
               ("count_rows_on_streams", check_count_rows_on_streams),
               ("answers_copied_together", check_answers_copied_together),
               ("graph_forward", _without_graph_trees(check_graph_forward)),
               ("graph_fused_backward", _without_graph_trees(check_graph_fused_backward)),
               ("graph_capturable_adam", _without_graph_trees(check_graph_capturable_adam)),
               ("graph_refuses_adam", _without_graph_trees(check_graph_refuses_adam)),
               ("deterministic_backward", check_deterministic_backward),
               ("cached_launches", check_cached_launches),
               ("long_lived_outside_pools", check_long_lived_outside_pools)]
