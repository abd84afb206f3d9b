"""Launch compiled Triton kernels with a fraction of ``kernel[grid](...)``'s host work.

``JITFunction.run`` redoes at every launch what only changes with the kernel variant: it
reads Triton's knobs, binds and specialises the arguments, turns the specialisation and
options into a cache-key string, checks that every global constant the kernel reads is
unchanged (``tl.constexpr.__ne__`` on each: the hash kernels read 13 of them), and only then
calls the variant's launcher. Measured with the launcher stubbed, that is 20-40 us a launch
on a 2-core VM, as much as all of the rest of a forward call's host work; on a GPU machine's
host it is more (benchmarks/results/host_overhead.md).

:class:`CachedLaunch` keeps what a variant needs. A variant's first launch goes through
``JITFunction.run``, which compiles it, and is remembered under the specialisation that
Triton's own binder (generated for the kernel) gives the arguments: the variant chosen,
which depends on argument values, alignment included, stays Triton's choice. A later launch
computes a cheaper key of its arguments (:func:`argument_key`: per argument the properties
Triton's specialisation reads, or finer); a key seen before names its variant and the
launcher's arguments, and only a new key is bound by Triton's binder (the op's call without
grad took 0.90x the time of binding at every launch on the project's host,
benchmarks/results/host_overhead.md). The variant's launcher is then called as
``JITFunction.run`` calls it. Left out: the cache-key string and the global-constant check
(the kernels' globals are constants of their modules). Triton's launch hooks still run (a
profiler's); with a pre-run hook on the kernel or a stage-inspection hook, every launch
goes through ``JITFunction.run``. Runtime knobs that change compilation
(``TRITON_DEBUG``...) are read when a variant is first compiled.

The launcher's calling convention (every parameter, constants included, in signature
order) is that of Triton 3.6 to 3.9; other versions, and :func:`~robe_torchrec.ops.tuning.
tuned` ``(cached_launch=False)``, launch through ``JITFunction.run``.
``tests/ops/cached_launches.py`` checks, with a stand-in CUDA driver and kernels compiled
for sm_90, that every launch of the ops gets the same variant and arguments both ways, and,
against the Triton it runs under, that arguments of one key always get one specialisation.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from robe_torchrec.ops.tuning import current as current_tuning

try:
    import triton
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction, create_function_from_signature

    #: Triton versions whose launcher convention this module follows (read in their source)
    SUPPORTED = (3, 6) <= tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 10)
except (ImportError, ValueError):  # no Triton (its kernels' import says so), or another one
    SUPPORTED = False

#: variants kept per kernel before starting over (a module sees a few layouts)
_MAX_VARIANTS = 256
#: argument keys kept per kernel before starting over (a few per variant: the int
#: arguments' ranges, the tensors' alignment)
_MAX_KEYS = 1024


def _int_width(value: int):
    """The type Triton gives an int outside int32: int64, uint64, or none (refused)."""
    if -2**63 <= value < 2**63:
        return 64
    return 65 if 0 <= value < 2**64 else None


def argument_key(args: tuple, constants: dict, _tensor=torch.Tensor) -> Optional[tuple]:
    """A key from which Triton's specialisation of a launch's arguments follows (equal keys
    get equal specialisations), cheaper to compute than Triton's binder. Per argument what
    Triton's specialisation reads, or finer: a tensor's dtype and whether its address is
    16-byte aligned; an int's being 1 (a constant), its divisibility by 16 and its type
    (int32, int64, uint64); a float only that it is one (Triton types every float fp32,
    whatever its value); bools and ``None`` themselves. Then the constants and options, by
    name and value (Triton's own cache keys a constant by its value too). ``None`` for an
    argument of another type (the launch then binds). ``args`` must be runtime parameters
    and ``constants`` constants and options only (:meth:`CachedLaunch._keyed`)."""
    key = []
    for arg in args:
        kind = type(arg)
        if kind is _tensor:
            key.append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif kind is int:  # (True == 1 and hashes alike: an int's key is never a bool)
            key.append("1" if arg == 1 else (
                arg & 15 == 0, 32 if -2147483648 <= arg <= 2147483647 else _int_width(arg)))
        elif kind is float:
            key.append(float)
        elif kind is bool:
            key.append((bool, arg))
        elif arg is None:
            key.append(None)
        elif isinstance(arg, _tensor):
            key.append((arg.dtype, arg.data_ptr() & 15 == 0))
        else:
            return None
    key.append(tuple(constants.items()))
    return tuple(key)


def _hooks_block_caching(fn: "JITFunction") -> bool:
    """Whether something observes or changes launches in a way only ``JITFunction.run``
    honours: a pre-run hook on the kernel, or a stage-inspection hook (a specialisation
    entry of its own)."""
    return bool(fn.pre_run_hooks) or getattr(knobs.runtime, "add_stages_inspection_hook",
                                             None) is not None


def _cuda_index(args: tuple) -> Optional[int]:
    """The CUDA device index of the first tensor in ``args`` (None: a CPU tensor, none)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.get_device() if arg.is_cuda else None
    return None


class CachedLaunch:
    """``fn[grid](*args, **constants)`` with the variant found without ``JITFunction.run``
    once it has been compiled. Indexing by a grid returns the launch, as for ``fn``."""

    def __init__(self, fn: "JITFunction"):
        self.fn = fn
        #: device index -> Triton's binder for the device's target
        self._binders: Dict[int, Callable] = {}
        #: (device, specialisation, options) -> compiled variant
        self._variants: Dict[Tuple, object] = {}
        #: (device, argument_key) -> (compiled variant, the launcher's arguments after the
        #: call's own)
        self._by_key: Dict[Tuple, Tuple[object, tuple]] = {}
        #: the kind of driver the caches were filled under (a stand-in driver, which reports
        #: device 0 too, or the real one)
        self._driver = None
        # argument_key reads positional arguments as runtime parameters and keywords as
        # constants or options: a call that passes a constant by position, or a runtime
        # parameter by keyword, is bound by Triton's binder instead
        params = getattr(fn, "params", None) or ()
        self._positional = next((i for i, p in enumerate(params) if p.is_constexpr),
                                len(params) if params else None)
        self._runtime = frozenset(p.name for p in params if not p.is_constexpr)

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **constants: self.launch(grid, args, constants)

    def launch(self, grid: Sequence[int], args: tuple, constants: dict) -> None:
        tensors_on = _cuda_index(args)
        if not SUPPORTED:
            if tensors_on is not None and tensors_on != torch.cuda.current_device():
                self._launch_on(tensors_on, grid, args, constants)
            else:
                self.fn[grid](*args, **constants)
            return
        active = driver.active
        if type(active) is not self._driver:  # compiled and bound for another driver
            self._binders.clear()
            self._variants.clear()
            self._by_key.clear()
            self._driver = type(active)
        device = active.get_current_device()
        if tensors_on is not None and tensors_on != device:
            self._launch_on(tensors_on, grid, args, constants)
            return
        binder = self._binders.get(device)
        if binder is None or not current_tuning().cached_launch or \
                _hooks_block_caching(self.fn):
            self._launch_and_remember(device, grid, args, constants)
            return
        key = argument_key(args, constants) if self._keyed(args, constants) else None
        try:
            known = self._by_key.get((device, key)) if key is not None else None
        except TypeError:  # a constant Triton can use but not hash
            key = known = None
        if known is not None:
            kernel, rest = known
            values = args + rest
        else:
            bound, specialization, options = binder(*args, **constants)
            try:
                kernel = self._variants.get((device, tuple(specialization),
                                             tuple(options.items())))
            except TypeError:  # a constant Triton can use but not hash: never cached
                kernel = None
            if kernel is None:
                self._launch_and_remember(device, grid, args, constants)
                return
            values = tuple(bound.values())
            if key is not None:
                self._remember_key(device, key, kernel, args, values)
        stream = active.get_current_stream(device)
        enter_hook = knobs.runtime.launch_enter_hook
        # the launch metadata (every argument packed again: 0.8 of a launch's 9 us on the
        # project's host) is for an enter hook to read; Triton keeps the hooks in a chain,
        # empty unless a profiler added one, and calling an empty chain reads nothing
        metadata = (kernel.launch_metadata(grid, stream, *values)
                    if getattr(enter_hook, "calls", enter_hook is not None) else None)
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   stream, kernel.function, kernel.packed_metadata, metadata,
                   enter_hook, knobs.runtime.launch_exit_hook, *values)

    def _keyed(self, args: tuple, constants: dict) -> bool:
        """Whether the call passes only runtime parameters by position and only constants
        and options by keyword, as :func:`argument_key` reads them."""
        return ((self._positional is None or len(args) <= self._positional)
                and self._runtime.isdisjoint(constants))

    def _remember_key(self, device: int, key: tuple, kernel, args: tuple,
                      values: tuple) -> None:
        """Remember that arguments of ``key`` launch ``kernel`` with ``values``: ``args``
        followed by what the constants and the kernel's defaults fill in, the same for every
        call of that key. Not when the binder passed ``args`` on in another order."""
        count = len(args)
        if len(values) < count or any(v is not a for v, a in zip(values, args)):
            return
        if len(self._by_key) >= _MAX_KEYS:
            self._by_key.clear()
        self._by_key[(device, key)] = (kernel, values[count:])

    def _launch_on(self, index: int, grid, args: tuple, constants: dict) -> None:
        """The launch on CUDA device ``index``, made current for it: Triton launches on the
        current device, on its stream, and the tensors are on this one (no
        ``torch.cuda.set_device`` was called), as torch's own ops guard theirs."""
        with torch.cuda.device(index):
            self.launch(grid, args, constants)

    def _launch_and_remember(self, device: int, grid, args: tuple, constants: dict) -> None:
        """Launch through ``JITFunction.run`` (compiling the variant if new) and remember the
        variant it ran under its specialisation."""
        kernel = self.fn[grid](*args, **constants)
        if kernel is None or _hooks_block_caching(self.fn):
            return
        binder = self._binders.get(device)
        if binder is None:
            backend = make_backend(driver.active.get_current_target())
            binder = self._binders[device] = create_function_from_signature(
                self.fn.signature, self.fn.params, backend)
        _, specialization, options = binder(*args, **constants)
        key = (device, tuple(specialization), tuple(options.items()))
        try:
            hash(key)
        except TypeError:  # a constant Triton can use but not hash: never cached
            return
        if len(self._variants) >= _MAX_VARIANTS:
            self._variants.clear()
            self._by_key.clear()
        self._variants[key] = kernel

    @property
    def variants(self) -> int:
        """How many compiled variants a launch can find without ``JITFunction.run``."""
        return len(self._variants)
