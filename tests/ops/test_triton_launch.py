"""The cached launch's bookkeeping, with stand-ins for Triton's driver, binder and compiled
kernels: which launches go through the kernel's own ``[grid]`` (``JITFunction.run``) and
which through a remembered variant's launcher. That the remembered variant and arguments are
the ones ``JITFunction.run`` would use is checked with real kernels, compiled for sm_90, by
``tests/ops/cached_launches.py``."""

import types

import pytest
from triton import knobs

from robe_torchrec.ops import triton_launch
from robe_torchrec.ops.tuning import tuned


class _Compiled:
    """Stands in for a compiled variant: records its launcher's calls."""
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def launch_metadata(self, grid, stream, *args):
        # Triton's returns None without an enter hook; this one says it was called
        return ("metadata", grid, stream, args)

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """Stands in for a ``JITFunction``: records its launches, returns its variant."""
    signature = params = None

    def __init__(self):
        self.launches = []
        self.pre_run_hooks = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.launches.append((grid, args, constants))
            return self.compiled
        return launch


class _Spec(list):
    """The stand-in binder's specialisation (``[0]``), and the binder (``binder``, which
    counts its ``calls``)."""


@pytest.fixture
def stand_ins(monkeypatch):
    """Triton's driver (device 0, stream 7) and a binder whose specialisation is
    ``spec[0]`` (a test may swap it)."""
    spec = _Spec([("i32", "D")])

    def binder(*args, **constants):
        binder.calls += 1
        return dict(enumerate(args), **constants), spec[0], {}
    binder.calls = 0
    spec.binder = binder

    driver = types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda device: 7,
        get_current_target=lambda: None))
    monkeypatch.setattr(triton_launch, "SUPPORTED", True)
    monkeypatch.setattr(triton_launch, "driver", driver)
    monkeypatch.setattr(triton_launch, "make_backend", lambda target: None)
    monkeypatch.setattr(triton_launch, "create_function_from_signature",
                        lambda signature, params, backend: binder)
    return spec


def test_a_compiled_variant_is_launched_without_the_kernel(stand_ins):
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(3):
        launch[(5,)](1, 2, BLOCK=4)
    assert len(kernel.launches) == 1 and launch.variants == 1  # compiled, remembered
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert kernel.compiled.runs == [(5, 1, 1, 7, "function", "metadata", None, *hooks,
                                     1, 2, 4)] * 2
    assert not hooks[0].calls  # an empty chain: the launch metadata was never built
    stand_ins[0] = [("i32", None)]  # another specialisation: another variant
    launch[(5,)](3, 2, BLOCK=4)
    assert len(kernel.launches) == 2 and launch.variants == 2
    with tuned(cached_launch=False):
        launch[(5,)](3, 2, BLOCK=4)
    assert len(kernel.launches) == 3 and len(kernel.compiled.runs) == 2


@pytest.mark.parametrize("how", ["added to the chain", "in place of the chain"])
def test_a_launch_enter_hook_gets_the_launch_metadata(stand_ins, monkeypatch, how):
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    launch[(5,)](1, 2, BLOCK=4)  # compiled, remembered
    hook = print  # a profiler's, say: the launcher calls it with the metadata
    if how == "added to the chain":
        chain = knobs.HookChain()
        chain.add(hook)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", chain)
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    launch[(5,)](1, 2, BLOCK=4)
    metadata = ("metadata", (5,), 7, (1, 2, 4))
    assert kernel.compiled.runs == [(5, 1, 1, 7, "function", "metadata", metadata,
                                     knobs.runtime.launch_enter_hook,
                                     knobs.runtime.launch_exit_hook, 1, 2, 4)]


def test_a_specialisation_that_cannot_be_hashed_is_never_cached(stand_ins):
    stand_ins[0] = [("constexpr", [1, 2])]
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(2):
        launch[(5,)](1)
    assert len(kernel.launches) == 2 and launch.variants == 0 and not kernel.compiled.runs


def test_a_pre_run_hook_sends_every_launch_through_the_kernel(stand_ins):
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    launch[(5,)](1)
    kernel.pre_run_hooks.append(print)
    launch[(5,)](1)
    assert len(kernel.launches) == 2 and not kernel.compiled.runs


def test_an_unsupported_triton_launches_every_time_through_the_kernel(monkeypatch):
    monkeypatch.setattr(triton_launch, "SUPPORTED", False)
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(2):
        launch[(3, 2)](1, 2.5, BLOCK=4)
    assert kernel.launches == [((3, 2), (1, 2.5), {"BLOCK": 4})] * 2
    assert launch.variants == 0


def test_a_launch_runs_on_its_tensors_device_not_the_current_one(stand_ins, monkeypatch):
    """Triton launches on the current CUDA device. Tensors on another (``cuda:1`` without
    ``torch.cuda.set_device(1)``) get a device guard for the launch, as torch's own ops do;
    tensors on the current device get none."""
    import contextlib

    import torch

    current, guards = [0], []

    @contextlib.contextmanager
    def guard(index):
        guards.append(index)
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", guard)
    monkeypatch.setattr(triton_launch.driver.active, "get_current_device", lambda: current[0])
    tensors_on = [1]
    monkeypatch.setattr(triton_launch, "_cuda_index", lambda args: tensors_on[0])
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    seen = []
    kernel.compiled.run = lambda *args: seen.append(current[0])
    for _ in range(2):
        launch[(5,)](1, 2, BLOCK=4)
    assert guards == [1, 1] and current == [0]
    assert seen == [1]  # the second launch: the variant remembered for device 1, run there
    tensors_on[0] = 0
    launch[(5,)](1, 2, BLOCK=4)
    assert guards == [1, 1]  # on the current device: no guard


def test_the_tensors_device_is_that_of_the_first_tensor_argument():
    import torch

    assert triton_launch._cuda_index((3, torch.zeros(2), torch.zeros(1))) is None  # CPU
    assert triton_launch._cuda_index((3, 4.0)) is None


def test_a_launch_binds_only_arguments_of_a_key_not_seen(stand_ins):
    """A launch whose arguments have a known key (:func:`argument_key`) finds its variant
    without Triton's binder; another key (an int no longer divisible by 16) binds again."""
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    launch[(5,)](16, 2.5, BLOCK=4)  # compiled, remembered
    launch[(5,)](16, 2.5, BLOCK=4)  # bound: its key remembered
    calls = stand_ins.binder.calls
    for value in (32, 48, 4096):
        launch[(5,)](value, 0.25, BLOCK=4)
    assert stand_ins.binder.calls == calls
    assert [run[-3:] for run in kernel.compiled.runs] == [
        (16, 2.5, 4), (32, 0.25, 4), (48, 0.25, 4), (4096, 0.25, 4)]
    launch[(5,)](17, 0.25, BLOCK=4)
    launch[(5,)](32, 0.25, BLOCK=8)  # another constant: another key
    assert stand_ins.binder.calls == calls + 2 and len(kernel.launches) == 1


def test_an_argument_of_a_type_the_key_does_not_know_binds_every_launch(stand_ins):
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(3):
        launch[(5,)]("text", BLOCK=4)
    assert len(kernel.launches) == 1 and len(kernel.compiled.runs) == 2
    assert stand_ins.binder.calls == 3


def test_a_constant_that_cannot_be_hashed_binds_every_launch(stand_ins):
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(3):
        launch[(5,)](3, BLOCK=[4])
    assert len(kernel.launches) == 1 and len(kernel.compiled.runs) == 2
    assert stand_ins.binder.calls == 3


def test_an_argument_key_tells_apart_what_triton_specialises_on():
    import torch

    key = triton_launch.argument_key
    block = torch.zeros(8)
    assert key((block,), {}) == key((torch.ones(4),), {})
    assert key((block,), {}) != key((block[1:],), {})  # 4 bytes past 16
    assert key((block,), {}) != key((block.double(),), {})
    assert key((16,), {}) == key((32,), {}) != key((17,), {})
    assert key((1,), {}) != key((17,), {}) and key((1,), {}) != key((True,), {})
    assert key((2**31 - 16,), {}) != key((2**31,), {}) != key((2**63,), {})
    assert key((0.5,), {}) == key((1e300,), {}) and key((None,), {"A": 1}) != key((None,), {})
    assert key((object(),), {}) is None


def _with_params(kernel, *params):
    """``kernel`` given Triton's parameter list: ``(name, is_constexpr)`` pairs."""
    kernel.params = [types.SimpleNamespace(name=name, is_constexpr=const)
                     for name, const in params]
    return kernel


@pytest.mark.parametrize("call", [
    lambda launch: launch[(5,)](16, 32, 128),       # a constant passed by position
    lambda launch: launch[(5,)](16, n=32, BLOCK=4),  # a runtime parameter by keyword
])
def test_a_call_the_key_cannot_read_binds_every_launch(stand_ins, call):
    """The key reads positions as runtime parameters and keywords as constants: a constant
    by position (Triton compiles a variant for each value) or a runtime parameter by
    keyword (16 and 16.0 are equal keys but not one variant) is bound every launch."""
    kernel = _with_params(_Kernel(), ("x", False), ("n", False), ("BLOCK", True))
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(3):
        call(launch)
    assert len(kernel.launches) == 1 and len(kernel.compiled.runs) == 2
    assert stand_ins.binder.calls == 3


def test_a_call_as_the_ops_make_it_is_keyed(stand_ins):
    kernel = _with_params(_Kernel(), ("x", False), ("n", False), ("BLOCK", True))
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(3):
        launch[(5,)](16, 32, BLOCK=4)
    assert len(kernel.compiled.runs) == 2 and stand_ins.binder.calls == 2


def test_another_driver_starts_the_caches_over(stand_ins, monkeypatch):
    """A stand-in driver (``recorded_launches``) reports device 0 as the real one does: what
    was compiled and bound under one is not launched under the other."""
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(2):
        launch[(5,)](1, 2, BLOCK=4)
    assert len(kernel.launches) == 1 and launch.variants == 1

    class _OtherDriver:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 7)
        get_current_target = staticmethod(lambda: None)

    monkeypatch.setattr(triton_launch.driver, "active", _OtherDriver())
    launch[(5,)](1, 2, BLOCK=4)
    assert len(kernel.launches) == 2 and launch.variants == 1  # compiled again, remembered
