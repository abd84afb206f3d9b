"""Deferred input checks (robe_torchrec.ops.deferred_checks), run by the Triton kernels on
CPU tensors in Triton's interpreter: the answers a GPU would read later are read later here
too. ``_Pending.done`` is patched to ``False`` where a test needs a device that lags behind
the host (on CPU every answer is ready at once)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this module

import subprocess
import sys
import textwrap
import types

import pytest
import torch

pytest.importorskip("triton")

from robe_torchrec.ops import answer_copies, count_rows  # noqa: E402
from robe_torchrec.ops import deferred_checks as dc  # noqa: E402
from robe_torchrec.ops import cpu_backend, defer_checks, raise_pending_checks  # noqa: E402
from robe_torchrec.ops import meta as m  # noqa: E402
from robe_torchrec.ops import triton_kernels as tk  # noqa: E402
from robe_torchrec.ops.deferred_checks import DeferredCheckError  # noqa: E402
from robe_torchrec.ops.tuning import tuned  # noqa: E402

from robe_torchrec.testing.op_cases import OpCase, case_matrix, random_case  # noqa: E402
from robe_torchrec.testing.op_checks import OPTIMIZERS, check_deferred_bad_input, fused_states  # noqa: E402

if not tk._is_interpreted(tk):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this file in its "
                "own process", allow_module_level=True)


@pytest.fixture(autouse=True)
def deferred():
    """Deferred checks on CPU tensors, each answer on its own (answers that share a copy:
    ``test_answers_copied_together_*``), and no answer left over from another test."""
    dc._pending.clear()
    with defer_checks(True), tuned(answers_per_copy=1):
        yield
    dc._pending.clear()


@pytest.fixture
def fresh_blocks(monkeypatch):
    """A new block of count rows: where the last one a process used stands (how many rows
    earlier tests took) would otherwise decide when a block's last row sends its copy."""
    monkeypatch.setattr(count_rows, "_blocks", {})
    monkeypatch.setattr(answer_copies, "_blocks", {})


@pytest.fixture
def lagging_device(monkeypatch):
    """Answers are never ready without a wait: as on a GPU the host runs ahead of."""
    monkeypatch.setattr(dc._Pending, "done", lambda self: self.clean is not None)


@pytest.fixture
def summaries(monkeypatch):
    """Counts the checks run on the device: the summary kernel's launches, and the forwards
    whose kernel counts the problems itself."""
    launches = []
    launch_summary, counts_in_kernel = tk._launch_summary, tk._counts_in_kernel

    def summary(*args):
        launches.append(("summary", args))
        return launch_summary(*args)

    def forward_counts(*args):
        counts = counts_in_kernel(*args)
        if counts:
            launches.append(("forward", args))
        return counts

    monkeypatch.setattr(tk, "_launch_summary", summary)
    monkeypatch.setattr(tk, "_counts_in_kernel", forward_counts)
    return launches


def weighted_case(**extra) -> OpCase:
    return random_case(**dict(case_matrix()[2], batch=4, **extra))


def bad_ids(case: OpCase) -> OpCase:
    values = case.values.clone()
    values[-1] = 10**9
    return OpCase(**{**case.__dict__, "values": values})


def decreasing_offsets(case: OpCase) -> OpCase:
    offsets = case.offsets.clone()
    offsets[1] = offsets[2] + 1
    return OpCase(**{**case.__dict__, "offsets": offsets})


def test_clean_input_gives_the_immediate_results_bitwise():
    case = weighted_case()
    g = case.grad()
    outputs = []
    for defer in (False, True):
        with defer_checks(defer):
            outputs.append((tk.forward(*case.forward_args()),
                            tk.backward_dense(*case.backward_args(g)),
                            tk.per_sample_weights_grad(*case.psw_grad_args(g))))
    for immediate, deferred in zip(*outputs):
        assert torch.equal(immediate, deferred)
    raise_pending_checks()


def test_bad_input_raises_later_with_the_reference_message():
    check_deferred_bad_input(random_case(**dict(case_matrix()[1], batch=4)))


def test_the_next_call_raises_an_earlier_problem():
    case = weighted_case()
    tk.forward(*bad_ids(case).forward_args())
    with pytest.raises(DeferredCheckError, match=r"id 1000000000 at position .* deferred"):
        tk.forward(*case.forward_args())
    tk.forward(*case.forward_args())  # raised once: the queue is clean again
    raise_pending_checks()


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_that_cannot_wait_writes_nothing_on_bad_input(lagging_device, summaries,
                                                                deterministic):
    """The device lags: the fused backward of the same inputs does not wait for the
    forward's answer; its kernels read the counts on the device and write nothing, weights
    and state stay as they were, and the problem raises at the next read. The same with
    the gradient summed in a fixed order (the deterministic backward)."""
    with tuned(deterministic_backward=deterministic):
        _writes_nothing_on_bad_input(summaries)


def _writes_nothing_on_bad_input(summaries):
    case = bad_ids(weighted_case())
    optimizer, hparams = OPTIMIZERS["adagrad"]
    weights, state = case.weights.clone(), fused_states(case, optimizer)
    kept = [weights.clone()] + [s.clone() for s in state]
    tk.forward(*case.forward_args())
    tk.forward(*weighted_case().forward_args())  # the bad answer stays unread
    assert len(dc._pending) == 2
    grad, _, *lookup = case.backward_args(case.grad())
    tk.backward_fused_(grad, weights, *state, *lookup, int(optimizer), hparams, 1)
    assert len(summaries) == 2, "the backward ran a summary of its own"
    for before, after in zip(kept, [weights] + state):
        assert torch.equal(before, after)
    # the dense and per-sample-weight gradients of bad input are all zeros
    assert not tk.backward_dense(*case.backward_args(case.grad())).any()
    assert not tk.per_sample_weights_grad(*case.psw_grad_args(case.grad())).any()
    with pytest.raises(DeferredCheckError, match="id 1000000000"):
        raise_pending_checks()
    # found once, the same inputs are refused again at the call
    with pytest.raises(DeferredCheckError, match="id 1000000000"):
        tk.backward_dense(*case.backward_args(case.grad()))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("step_dtype", [torch.int64, torch.float32])
def test_a_guarded_update_leaves_a_device_step_count_as_it_was(lagging_device, name,
                                                               step_dtype):
    """A capturable optimizer counts its steps on the device: the host advances the count
    before the launch, and when the guard stops the kernels' writes the kernel takes it
    back, as a raise at the call leaves it; a clean update advances it by one."""
    optimizer, hparams = OPTIMIZERS[name]
    # an array of several optimizer programs: only one of them takes the step back
    size = dict(memory_size=3001)
    for case, advanced in ((bad_ids(weighted_case(**size)), 0), (weighted_case(**size), 1)):
        weights, state = case.weights.clone(), fused_states(case, optimizer)
        kept = [weights.clone()] + [s.clone() for s in state]
        step = torch.tensor(4, dtype=step_dtype)
        tk.forward(*case.forward_args())
        grad, _, *lookup = case.backward_args(case.grad())
        tk.counted_backward_fused_(grad, weights, *state, step, int(optimizer), hparams,
                                   *lookup)
        assert step.item() == 4 + advanced
        assert all(torch.equal(a, b) for a, b in zip(kept, [weights] + state)) != advanced
        if not advanced:
            with pytest.raises(DeferredCheckError, match="id 1000000000"):
                raise_pending_checks()
    raise_pending_checks()


@pytest.mark.parametrize("counted", ["device", "host"])
def test_an_update_that_raises_at_the_call_leaves_the_step_count(counted):
    """Checks read at the call: bad input raises before the step count moves, whether the
    Triton op keeps the count on the device or the op reads it on the host."""
    case = decreasing_offsets(weighted_case())
    optimizer, hparams = OPTIMIZERS["adam"]
    weights, state = case.weights.clone(), fused_states(case, optimizer)
    grad, _, *lookup = case.backward_args(case.grad())
    step = torch.tensor(4.0)
    with defer_checks(False), pytest.raises(ValueError, match="offsets decrease"):
        if counted == "device":
            tk.counted_backward_fused_(grad, weights, *state, step, int(optimizer), hparams,
                                       *lookup)
        else:
            with cpu_backend("triton"):
                torch.ops.robe.counted_backward_fused_(grad, weights, *state, step,
                                                       int(optimizer), hparams, *lookup)
    assert step.item() == 4.0


def test_counts_read_on_another_stream_are_kept_for_that_stream(monkeypatch):
    """A backward on another stream than its forward reads the forward's counts there:
    they are recorded for that stream (``record_stream``), so that their memory is not
    handed out again before the read; on their own stream, or in a capture, they are not
    (CUDA's streams and tensors stand in)."""
    recorded = []
    counts = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0),
                                   record_stream=recorded.append)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream 7 of {device}")
    monkeypatch.setattr(count_rows, "stream_of", lambda device: 7)
    dc._read_on_current_stream(counts, stream=7)
    assert recorded == []
    dc._read_on_current_stream(counts, stream=3)
    assert recorded == ["stream 7 of cuda:0"]
    monkeypatch.setattr(dc, "is_capturing", lambda: True)
    dc._read_on_current_stream(counts, stream=3)
    assert len(recorded) == 1


def test_a_backward_that_uses_the_forward_s_counts_keeps_them_for_its_stream(
        lagging_device, monkeypatch):
    reads = []
    monkeypatch.setattr(dc, "_read_on_current_stream",
                        lambda counts, stream: reads.append(counts))
    case = weighted_case()
    tk.forward(*case.forward_args())
    [pending] = dc._pending
    tk.backward_dense(*case.backward_args(case.grad()))
    assert len(reads) == 1 and reads[0] is pending.device_counts
    raise_pending_checks()


def test_backward_raises_a_finished_bad_answer_before_writing(summaries):
    """The forward's answer is ready (the device kept up): the backward reads it and
    raises before anything is written."""
    case = bad_ids(weighted_case())
    optimizer, hparams = OPTIMIZERS["adagrad"]
    weights, state = case.weights.clone(), fused_states(case, optimizer)
    kept = [weights.clone()] + [s.clone() for s in state]
    tk.forward(*case.forward_args())
    grad, _, *lookup = case.backward_args(case.grad())
    with pytest.raises(DeferredCheckError, match="id 1000000000"):
        tk.backward_fused_(grad, weights, *state, *lookup, int(optimizer), hparams, 1)
    for before, after in zip(kept, [weights] + state):
        assert torch.equal(before, after)


@pytest.mark.parametrize("defer", [True, False])
def test_backward_reuses_the_forward_check_of_the_same_inputs(lagging_device, summaries, defer):
    """Deferred or read at the call, the forward's check serves the backward ops."""
    case = weighted_case()
    g = case.grad()
    with defer_checks(defer):
        tk.forward(*case.forward_args())
    tk.backward_dense(*case.backward_args(g))
    tk.per_sample_weights_grad(*case.psw_grad_args(g))
    assert len(summaries) == 1, "a backward checked the forward's inputs again"

    # different per-sample weights, or values changed in place: checked again, at once
    other = OpCase(**{**case.__dict__, "per_sample_weights": case.per_sample_weights.clone()})
    tk.backward_dense(*other.backward_args(g))
    assert len(summaries) == 2
    case.values.add_(0)
    tk.backward_dense(*case.backward_args(g))
    assert len(summaries) == 3


def test_backward_with_another_table_meta_checks_again(lagging_device, summaries):
    """The forward's answer holds for the table_meta it was checked against only."""
    case = weighted_case()
    g = case.grad()
    tk.forward(*case.forward_args())
    other = OpCase(**{**case.__dict__, "table_meta": case.table_meta.clone()})
    tk.backward_dense(*other.backward_args(g))
    assert len(summaries) == 2


def test_a_bounds_check_vouches_for_the_reference_key_limit(lagging_device, summaries):
    """Reference hash: the forward checks ids against num_rows, the backward needs keys below
    the hash's limit; in-range ids imply it, so the backward reuses the forward's answer."""
    case = random_case(**dict(case_matrix()[1], batch=4))  # reference hash, bounds ERROR
    tk.forward(*case.forward_args())
    tk.backward_dense(*case.backward_args(case.grad()))
    assert len(summaries) == 1


@pytest.mark.parametrize("defer", [True, False])
def test_the_forward_kernel_counts_its_own_checks_unless_it_skips_ids(summaries, defer):
    """The forward counts the checks' problems in its own kernel (no summary launch), and
    falls back to the summary kernel when the kernel would not read every id: a feature with
    no column (dim 0), or no bag to pool. Either way a bad id raises."""
    case = weighted_case()
    with defer_checks(defer):
        tk.forward(*case.forward_args())
    assert [kind for kind, _ in summaries] == ["forward"]

    dims = [4, 0]  # the second feature has ids but no column: its ids are still checked
    meta = m.build_table_meta(dims, [0, 0], [64, 64], [0, 10], [10, 10], [0, 0])
    values, offsets = torch.tensor([1, 2, 10]), torch.tensor([0, 1, 2, 3, 3])
    args = (torch.randn(64), values, offsets, None, meta, 4, 2, 0, [1, 2, 3], 0)
    summaries.clear()
    with defer_checks(defer):
        with pytest.raises(ValueError, match=r"id 10 at position 2 of feature 1"):
            tk.forward(*args)
            raise_pending_checks()
    assert [kind for kind, _ in summaries] == ["summary"]


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_without_a_forward_guards_its_writes(lagging_device, deterministic):
    """No forward checked these inputs: the backward runs the summary kernel, does not
    wait for it, writes nothing on bad input, and the problem raises at the next read."""
    case = decreasing_offsets(weighted_case())
    with tuned(deterministic_backward=deterministic):
        assert not tk.backward_dense(*case.backward_args(case.grad())).any()
    with pytest.raises(DeferredCheckError, match="offsets decrease at bag"):
        raise_pending_checks()


def test_backward_without_a_forward_checks_at_once_when_not_deferred():
    case = decreasing_offsets(weighted_case())
    with defer_checks(False), pytest.raises(ValueError, match="offsets decrease") as raised:
        tk.backward_dense(*case.backward_args(case.grad()))
    assert not isinstance(raised.value, DeferredCheckError)  # raised at its own call


def test_input_changed_before_the_answer_is_read_is_described_by_counts(lagging_device):
    case = bad_ids(weighted_case())
    tk.forward(*case.forward_args())
    case.values[-1] = 0  # repaired in place: the one-by-one checks would find nothing
    with pytest.raises(DeferredCheckError, match="1 ids that fail their check; it changed"):
        raise_pending_checks()


def test_unread_answers_are_bounded(lagging_device):
    case = weighted_case()
    for _ in range(dc.MAX_PENDING + 5):
        tk.forward(*case.forward_args())
        assert len(dc._pending) <= dc.MAX_PENDING
    raise_pending_checks()
    assert not dc._pending


def test_answers_copied_together_are_read_once_the_copy_is_full(summaries, fresh_blocks):
    """Four answers a copy: a bad forward's problem is not known until the copy carrying it
    has gone out, three forwards later; the backward of the bad input, given in between,
    writes nothing; then the next call raises it, named."""
    case, clean = bad_ids(weighted_case()), weighted_case()
    optimizer, hparams = OPTIMIZERS["adagrad"]
    weights, state = case.weights.clone(), fused_states(case, optimizer)
    kept = [weights.clone()] + [s.clone() for s in state]
    with tuned(answers_per_copy=4):
        tk.forward(*case.forward_args())
        tk.forward(*clean.forward_args())
        assert not any(p.done() for p in dc._pending), "an answer was read before its copy"
        grad, _, *lookup = case.backward_args(case.grad())
        tk.backward_fused_(grad, weights, *state, *lookup, int(optimizer), hparams, 1)
        assert len(summaries) == 2, "the backward ran a summary of its own"
        for before, after in zip(kept, [weights] + state):
            assert torch.equal(before, after)
        tk.forward(*clean.forward_args())
        tk.forward(*clean.forward_args())  # the fourth answer: the copy goes out
        with pytest.raises(DeferredCheckError, match=r"id 1000000000 at position .* deferred"):
            tk.forward(*clean.forward_args())
    raise_pending_checks()


def test_answers_copied_together_are_read_at_once_when_waited_for(fresh_blocks):
    """A wait for every answer sends the copy not yet full, and the answers are bounded as
    they are one a copy."""
    case = weighted_case()
    with tuned(answers_per_copy=8):
        tk.forward(*bad_ids(case).forward_args())
        with pytest.raises(DeferredCheckError, match="id 1000000000"):
            raise_pending_checks()
        for _ in range(dc.MAX_PENDING + 5):
            tk.forward(*case.forward_args())
            assert len(dc._pending) <= dc.MAX_PENDING
        raise_pending_checks()
    assert not dc._pending


def test_the_gpu_check_of_answer_copies_runs_on_cpu():
    from robe_torchrec.ops import cpu_backend
    from robe_torchrec.testing.gpu_checks import check_answers_copied_together

    with cpu_backend("triton"):
        check_answers_copied_together("cpu")


@pytest.mark.parametrize("backend,deferred", [("triton", False), ("cpp", False),
                                              ("triton", True)])
def test_the_gpu_check_of_the_unpooled_lookup_runs_on_cpu(backend, deferred):
    """Deferred, the Triton kernels on CPU tensors take the GPU's path: ids checked on the
    device, the problem read at a later call."""
    from robe_torchrec.ops import cpu_backend
    from robe_torchrec.testing.gpu_checks import check_unpooled_no_host_sync

    with cpu_backend(backend), defer_checks(deferred):
        check_unpooled_no_host_sync("cpu")


def test_module_training_step_raises_before_the_fused_update():
    """A TorchRec user's step: the module's forward on bad ids returns, the backward raises
    the deferred error, naming the feature from the table_meta of the call that took the
    input, and the array keeps its values."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.optim import apply_optimizer_in_backward

    from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
    from robe_torchrec.ops import cpu_backend

    tables = [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100,
                                 feature_names=["f"])]
    module = RobeEmbeddingBagCollection(tables, RobeConfig(memory_size=256, block_size=4))
    apply_optimizer_in_backward(torch.optim.Adagrad, [module.weight], {"lr": 0.1})
    kept = module.weight.detach().clone()
    features = KeyedJaggedTensor(keys=["f"], values=torch.tensor([3, 100, 5]),
                                 lengths=torch.tensor([1, 1, 1]))
    with cpu_backend("triton"):
        pooled = module(features).values()
        with pytest.raises(DeferredCheckError, match=r"id 100 at position 1 of feature 0 \('f'\) is"):
            pooled.sum().backward()
    assert torch.equal(module.weight.detach(), kept)


def test_the_mode_follows_the_device_and_the_environment(monkeypatch):
    monkeypatch.setattr(dc, "_setting", None)
    assert dc.deferred_for(torch.device("cuda")) and not dc.deferred_for(torch.device("cpu"))
    for value, expected in (("0", False), ("1", True), ("auto", None), ("", None)):
        monkeypatch.setenv("ROBE_DEFER_CHECKS", value)
        assert dc._setting_from_env() is expected
    monkeypatch.setenv("ROBE_DEFER_CHECKS", "sometimes")
    with pytest.raises(ValueError, match="ROBE_DEFER_CHECKS='sometimes'; expected 1"):
        dc._setting_from_env()


_WILD_INPUT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from robe_torchrec.hashing import HashMode, hash_params
    from robe_torchrec.ops import defer_checks, raise_pending_checks
    from robe_torchrec.ops import triton_kernels as tk
    from robe_torchrec.ops.deferred_checks import DeferredCheckError
    from robe_torchrec.ops.meta import BoundsCheck, build_table_meta

    # the backward kernels run on the wild input too (a backward normally refuses it first):
    # no forward's answer is found, and the backward's own summary finds nothing
    import robe_torchrec.ops.deferred_checks as dc
    dc.earlier_check = lambda *args: None
    dc.raise_ready = lambda: None
    tk._launch_summary = lambda *args: torch.zeros(4, dtype=torch.int64)
    meta = build_table_meta([8, 8], [0, 0], [64, 64], [0, 10], [10, 10], [0, 0])
    weights = torch.randn(64)
    params = hash_params(HashMode.REFERENCE, seed=3)
    psw = torch.rand(4)
    cases = {
        "offsets far past values": (torch.tensor([1, 2, 3, 4]),
                                    torch.tensor([0, 2**40, 2, -2**40, 4])),
        "ids that wrap the reference hash": (torch.tensor([2**62, -2**62, 7, 2**63 - 1]),
                                             torch.tensor([0, 1, 2, 3, 4])),
    }
    for name, (values, offsets) in cases.items():
        with defer_checks(True):
            out = tk.forward(weights, values, offsets, psw, meta, 16, 4, 0, params,
                             int(BoundsCheck.UNBOUNDED))
            tk.backward_dense(out, weights, values, offsets, psw, meta, 4, 0, params)
            tk.per_sample_weights_grad(out, weights, values, offsets, meta, 4, 0, params)
        try:
            raise_pending_checks()
        except DeferredCheckError as exc:
            print(name, "->", exc)
""")


def test_wild_input_never_reads_outside_its_tensors():
    """Offsets a terabyte past ``values`` and ids whose hash wraps negative reach the kernels
    when checks are deferred; the kernels clamp them, the process survives (in a child, so
    that a wild read fails this test instead of the run) and the problem is reported."""
    result = subprocess.run([sys.executable, "-c", _WILD_INPUT], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "offsets far past values -> robe: offsets" in result.stdout, result.stdout
    assert "ids that wrap the reference hash -> robe: id" in result.stdout, result.stdout


_UNREAD_AT_EXIT = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from robe_torchrec.hashing import HashMode, hash_params
    from robe_torchrec.ops import defer_checks
    from robe_torchrec.ops import triton_kernels as tk
    from robe_torchrec.ops.meta import build_table_meta

    meta = build_table_meta([8], [0], [64], [0], [10], [0])
    with defer_checks(True):  # 8 answers a copy: this one never went out
        tk.forward(torch.randn(64), torch.tensor([1, 50]), torch.tensor([0, 1, 2]), None,
                   meta, 8, 4, 0, hash_params(HashMode.REFERENCE, seed=3), 0)
    print("returned")
    if os.fork() == 0:  # a forked child that exits normally reads nothing of the parent's
        raise SystemExit(0)
    os.wait()
""")


def test_a_problem_unread_at_exit_is_printed():
    """A script that ends without reading its last answers still hears of their problem."""
    result = subprocess.run([sys.executable, "-c", _UNREAD_AT_EXIT], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "returned" in result.stdout, result.stderr[-2000:]
    assert result.stderr.count("unread when the process ended found a problem: robe: id 50 "
                               "at position 1") == 1, result.stderr[-2000:]


def test_wrapped_reference_hash_still_lands_in_the_array():
    """Keys past the reference hash's limit overflow int64 and could give a negative start
    (a read before the array); the kernels' hash moves every start into ``[0, span)``."""
    from robe_torchrec.hashing import HashMode, hash_params

    keys = torch.tensor([2**62, -2**62, 2**63 - 1, -(2**63), 12345, -7])
    memory_size, block_size = 1000, 8
    for seed in range(20):
        starts = tk.block_starts(keys, 16, memory_size, block_size, int(HashMode.REFERENCE),
                                 hash_params(HashMode.REFERENCE, seed=seed))
        assert int(starts.min()) >= 0 and int(starts.max()) <= memory_size - block_size


def test_registered_op_backward_reuses_the_forward_check(lagging_device, summaries):
    """Through ``torch.ops.robe.forward``'s autograd, as a model trains: one summary a step."""
    from robe_torchrec.ops import cpu_backend

    case = weighted_case()
    weights = case.weights.clone().requires_grad_(True)
    psw = case.per_sample_weights.clone().requires_grad_(True)
    args = case.forward_args()
    with cpu_backend("triton"):
        out = torch.ops.robe.forward(weights, args[1], args[2], psw, *args[4:])
        out.sum().backward()
    assert len(summaries) == 1
    assert weights.grad is not None and psw.grad is not None


def test_capture_is_asked_of_torch_once_cuda_started(monkeypatch):
    """``is_capturing`` reads torch's capture state once CUDA is initialised (without a GPU
    it is never asked: CUDA never starts), and says so."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for capturing in (True, False):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        assert dc.is_capturing() is capturing
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert dc.is_capturing() is False


# --- checks recorded in CUDA graphs: every replay's problems reach the host -------------------

@pytest.fixture
def captured(monkeypatch):
    """A stand-in for a CUDA graph on CPU tensors: ``record(fn)`` runs ``fn`` as if captured
    (on the CPU its ops run at once, as a replay would run them); the device's replay tally
    made beforehand, as a warm-up call makes it on a GPU, and a warm-up call of the tables
    the tests capture (it copies their hash's terms to the device, which a capture cannot)."""
    import collections

    monkeypatch.setattr(dc, "_captured", collections.deque(maxlen=dc.MAX_PENDING))
    monkeypatch.setattr(dc, "_graphs_checked", False)
    monkeypatch.setattr(dc, "_tallies", {})
    dc.prepare_tally(torch.zeros(4, dtype=torch.int64))
    tk.forward(*weighted_case().forward_args())
    raise_pending_checks()

    def record(fn):
        monkeypatch.setattr(dc, "is_capturing", lambda: True)
        try:
            fn()
        finally:
            monkeypatch.setattr(dc, "is_capturing", lambda: False)
    return record


def test_a_bad_replay_that_a_clean_one_followed_still_raises(captured):
    """A replay rewrites its own counts: the last replay was clean, yet the tally of every
    replay since the last read holds the bad one, and a glance (no wait) raises it, once."""
    case = weighted_case()
    captured(lambda: tk.forward(*bad_ids(case).forward_args()))
    [check] = dc.captured_checks()
    check.counts.zero_()  # what the next, clean, replay leaves in the graph's own counts
    with pytest.raises(DeferredCheckError, match="CUDA graph replays since the last read took "
                                                 "input with 1 ids that fail their check"):
        dc.raise_ready()
    dc.raise_ready()
    raise_pending_checks()


def test_the_last_replay_bad_is_named_from_its_inputs(captured):
    case = weighted_case()
    captured(lambda: tk.forward(*bad_ids(case).forward_args()))
    with pytest.raises(DeferredCheckError, match=r"id 1000000000 at position"):
        raise_pending_checks()
    # read: the tally starts again from 0 (the graph's own counts hold until a replay)
    assert dc._tallies[torch.device("cpu")].host.tolist() == [0, 0, 0, 0]
    dc.captured_checks()[0].counts.zero_()  # a clean replay
    raise_pending_checks()


def test_a_newer_graph_s_problem_is_named_not_an_older_one_s(captured):
    """Two graphs: the older one's bad replay is named and raised once; when the newer
    graph's replay has a problem, that one is named, not the older graph's, whose counts
    still held its last replay's problem."""
    older = bad_ids(weighted_case())
    captured(lambda: tk.forward(*older.forward_args()))
    with pytest.raises(DeferredCheckError, match=r"id 1000000000 at position"):
        raise_pending_checks()
    newer = decreasing_offsets(weighted_case())
    captured(lambda: tk.forward(*newer.forward_args()))
    with pytest.raises(DeferredCheckError, match=r"offsets decrease") as raised:
        raise_pending_checks()
    assert "1000000000" not in str(raised.value)
    raise_pending_checks()


def test_counts_no_replay_since_the_last_read_wrote_are_not_named(captured):
    """A graph not replayed yet holds whatever its memory held: counts above what the
    replays since the last read tallied name nothing, and the replay's own problem is
    named (both graphs stand in: the older one's counts are set by hand)."""
    captured(lambda: tk.forward(*weighted_case().forward_args()))
    dc.captured_checks()[0].counts.copy_(torch.tensor([0, 7, 0, 0]))
    raise_pending_checks()  # nothing tallied: the stale counts are not read
    captured(lambda: tk.forward(*bad_ids(weighted_case()).forward_args()))
    with pytest.raises(DeferredCheckError, match=r"id 1000000000 at position") as raised:
        raise_pending_checks()
    assert "more CUDA graph" not in str(raised.value)


def test_under_graph_trees_a_recorded_check_keeps_nothing_yet_replays_raise(captured,
                                                                             monkeypatch):
    """Where a CUDA graph pool may claim them (Inductor's CUDA graph trees), a check
    recorded in a graph keeps neither its counts nor its inputs; the replay tally alone
    carries a replay's problem to the host, told by its counts."""
    monkeypatch.setattr(dc, "pools_may_claim", lambda device: True)
    bad = bad_ids(weighted_case())
    captured(lambda: tk.forward(*bad.forward_args()))
    plan = tk._forward_plan(*bad.forward_args())
    assert dc.captured_checks() == []
    assert dc.earlier_check(bad.values, bad.offsets, None, plan.meta_cpu, plan.id_check) is None
    with pytest.raises(DeferredCheckError, match="CUDA graph replays since the last read took "
                                                 "input with 1 ids that fail their check"):
        raise_pending_checks()
    raise_pending_checks()


def test_under_graph_trees_a_recorded_backward_is_guarded_by_the_replay_tally(captured,
                                                                              monkeypatch):
    """A recorded backward cannot read its forward's counts under the graph trees (another
    graph, memory they count as free): it guards its writes with the replay tally, which
    the forward's replay fills first. A bad id (a key of no table's rows: only the
    forward's bounds check sees it) changes no weight, and is counted once."""
    monkeypatch.setattr(dc, "pools_may_claim", lambda device: True)
    bad = bad_ids(weighted_case())
    optimizer, hparams = OPTIMIZERS["adagrad"]
    weights, state = bad.weights.clone(), fused_states(bad, optimizer)
    before = weights.clone()
    grad, _, *lookup = bad.backward_args(bad.grad())

    def step():
        tk.forward(*bad.forward_args())
        tk.backward_fused_(grad, weights, *state, *lookup, int(optimizer), hparams, 1)

    captured(step)
    assert torch.equal(weights, before), "a recorded backward wrote on bad input"
    with pytest.raises(DeferredCheckError, match="input with 1 ids that fail their check;"):
        raise_pending_checks()


def test_under_graph_trees_a_check_recorded_before_any_tally_refuses(captured, monkeypatch):
    """Nothing would carry that graph's replays' problems to the host: the capture says so
    rather than drop them."""
    monkeypatch.setattr(dc, "pools_may_claim", lambda device: True)
    monkeypatch.setattr(dc, "_tallies", {})
    with pytest.raises(RuntimeError, match="before any call on this device outside a graph"):
        captured(lambda: tk.forward(*bad_ids(weighted_case()).forward_args()))


def test_clean_replays_raise_nothing(captured):
    case = weighted_case()
    captured(lambda: tk.forward(*case.forward_args()))
    dc.raise_ready()
    raise_pending_checks()


def test_a_fused_optimizer_step_reads_the_replays(captured):
    """TorchRec's train loops call the fused optimizers' step() every iteration: under
    reduce-overhead, where a replay runs nothing of ours on the host, that is where it shows."""
    from robe_torchrec.optim import RobeFusedOptimizer

    case = weighted_case()
    captured(lambda: tk.forward(*bad_ids(case).forward_args()))
    dc.captured_checks()[0].counts.zero_()
    optimizer = RobeFusedOptimizer("weight", case.weights, torch.optim.Adagrad, {"lr": 0.1})
    with pytest.raises(DeferredCheckError, match="CUDA graph replays"):
        optimizer.step()


def test_the_sharded_fused_optimizer_step_reads_the_replays_too(monkeypatch):
    from robe_torchrec.distributed import sharder

    reads = []
    monkeypatch.setattr(sharder, "raise_ready", lambda **how: reads.append(how))
    optimizer = object.__new__(sharder.ShardedRobeFusedOptimizer)  # its state is not read
    optimizer.step()
    assert reads == [{"send_idle": True}]


def test_inside_a_capture_checks_are_deferred_and_nothing_waits(monkeypatch):
    """A CUDA graph capture refuses every wait for the device: checks read at the call
    (``defer_checks(False)``) are deferred there all the same, and ``raise_pending_checks``
    says to call it after the capture instead of breaking it."""
    monkeypatch.setattr(dc, "is_capturing", lambda: True)
    with defer_checks(False):
        assert dc.deferred_for(torch.device("cuda", 0))
        assert not dc.deferred_for(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="call it after the capture"):
        raise_pending_checks()
    monkeypatch.setattr(dc, "is_capturing", lambda: False)
    with defer_checks(False):
        assert not dc.deferred_for(torch.device("cuda", 0))


def test_a_table_meta_first_copied_inside_a_capture_is_refused(monkeypatch):
    monkeypatch.setattr(dc, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        tk._meta_on(torch.zeros(8, 2, dtype=torch.int64), torch.device("cuda", 0))


def test_where_a_graph_pool_may_claim_them_no_input_is_kept(monkeypatch):
    """Under Inductor's CUDA graph trees an op's inputs may be memory of their pool, which
    they refuse to see kept past a warm-up and hand to a later graph: a deferred check then
    keeps no input (the caller's drop frees them) and tells a problem by its counts, with
    how to have it named. Its counts are a row made outside any pool."""
    import gc
    import weakref

    monkeypatch.setattr(dc, "pools_may_claim", lambda device: True)
    case = bad_ids(weighted_case())
    values = case.values.clone()
    kept = weakref.ref(values)
    tk.forward(case.weights, values, *case.forward_args()[2:])
    del values
    gc.collect()
    assert kept() is None, "a deferred check kept its input"
    with pytest.raises(DeferredCheckError, match="1 ids that fail their check; under "
                       "torch.compile's CUDA graphs the ops keep no input to name it by"):
        raise_pending_checks()


def test_a_graph_check_is_read_only_when_replayed_since_a_problem_showed(monkeypatch):
    """A check recorded in a CUDA graph names the last replay's problem. Its counts are read
    only when the replay tally says a replay since the last read had a problem, and its
    own replay counter says it was replayed since: a graph not replayed yet holds whatever
    its memory held, and an old graph's last problem, raised once, must not raise at every
    later read. Nothing is written to the graph's counts. (CPU tensors stand in.)"""
    import collections

    case = bad_ids(weighted_case())
    plan = tk._forward_plan(*case.forward_args())
    inputs = (case.values, case.offsets, case.per_sample_weights, case.table_meta,
              plan.meta_cpu, plan.id_check)
    tally = dc._ReplayTally(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                            torch.zeros(dc.REPLAY_SLOTS, dtype=torch.int64))
    monkeypatch.setattr(dc, "_tallies", {torch.device("cpu"): tally})
    check = dc.CapturedCheck(torch.tensor([0, 1, 0, 0]), inputs, slot=3)
    monkeypatch.setattr(dc, "_captured", collections.deque([check], maxlen=16))
    monkeypatch.setattr(dc, "_graphs_checked", True)

    def replay(problems, graph_replayed):
        tally.device += torch.tensor(problems)
        tally.host.copy_(tally.device)
        tally.replays[3] += int(graph_replayed)

    raise_pending_checks()  # no replay counted a problem: nothing read
    replay([0, 1, 0, 0], graph_replayed=False)  # another graph's, not recorded here
    with pytest.raises(DeferredCheckError, match="input with 1 ids that fail their check"):
        raise_pending_checks()  # told by its counts: this graph was not replayed
    replay([0, 1, 0, 0], graph_replayed=True)
    with pytest.raises(DeferredCheckError, match="id 1000000000 at position"):
        raise_pending_checks()
    raise_pending_checks()  # raised once: the tally starts again from 0
    replay([0, 1, 0, 0], graph_replayed=False)
    with pytest.raises(DeferredCheckError, match="input with 1 ids") as raised:
        raise_pending_checks()  # the old graph's problem is not named again
    assert "1000000000" not in str(raised.value)
    assert check.counts.tolist() == [0, 1, 0, 0]


def test_a_graph_captured_under_inference_mode_is_read(captured, monkeypatch):
    """Serving captures its graphs under ``torch.inference_mode()``: the counts (made in the
    capture, as a capture takes no count row) are inference tensors, which a read outside
    that mode must not write. The inputs carry no version either, so the problem is told
    by its counts."""
    monkeypatch.setattr(count_rows, "usable", lambda device: False)
    with torch.inference_mode():
        captured(lambda: tk.forward(*bad_ids(weighted_case()).forward_args()))
    assert dc.captured_checks()[-1].counts.is_inference()
    with pytest.raises(DeferredCheckError, match=r"1 ids that fail their check; it changed"):
        raise_pending_checks()
    raise_pending_checks()


def test_an_optimizer_step_sends_the_copies_of_streams_no_forward_runs_on(monkeypatch):
    """A warm-up under Inductor's CUDA graph trees runs on their stream, which no later
    forward of ours runs on (replays run nothing on the host): the step sends that copy so
    that the next read finds its answers; a copy of the current stream waits to fill up.
    (Streams and the send stand in for CUDA's.)"""
    here, elsewhere = (types.SimpleNamespace(device=0, name=n) for n in ("here", "elsewhere"))
    sent = []

    def open_copy(stream):
        copy = answer_copies.AnswerCopy.__new__(answer_copies.AnswerCopy)
        copy._stream = stream
        copy.sent = False
        return types.SimpleNamespace(open=copy)

    blocks = {1: open_copy(here), 2: open_copy(elsewhere), 3: types.SimpleNamespace(open=None)}
    monkeypatch.setattr(answer_copies, "_blocks", blocks)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: here)
    monkeypatch.setattr(answer_copies.AnswerCopy, "_send", lambda self: sent.append(self))
    dc.raise_ready()
    assert sent == []
    dc.raise_ready(send_idle=True)
    assert sent == [blocks[2].open]
