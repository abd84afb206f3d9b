"""Triton kernels of the ROBE-Z ops: the implementation for CUDA tensors.

Same signatures as :mod:`robe_torchrec.ops.reference` (and the registered ``torch.ops.robe``
ops). On CPU tensors the kernels run in Triton's interpreter (numpy, slow; how CI tests them)
when ``TRITON_INTERPRET=1`` was set before triton was imported; see :func:`_kernels_for`.

The kernels themselves are in :mod:`robe_torchrec.ops.triton` (one module per phase, its
docstring lays out the work); this module is their host side: tile sizes, input checks,
launches. It imports every kernel as an attribute of its own (:func:`_kernels_for` returns
it), so a test reaches them here. Benchmarks of the host's time per call use the public
seams: :func:`stubbed_launches`, and :mod:`robe_torchrec.ops.tuning` for launch parameters.
"""

import contextlib
import math
import os
import sys
import types
from typing import Dict, List, NamedTuple, Optional

import torch

from robe_torchrec.hashing import reference_block_terms, to_signed64
from robe_torchrec.ops import count_rows, deferred_checks
from robe_torchrec.ops import meta as m
# the kernels, attributes of this module (see the module's docstring)
from robe_torchrec.ops.triton.backward import (  # noqa: F401
    _backward_kernel, _backward_short_bags_kernel, _gather_gradient_kernel, _psw_grad_kernel)
from robe_torchrec.ops.triton.common import _TRITON_IMPORT_ERROR, tl
from robe_torchrec.ops.triton.forward import (  # noqa: F401
    _forward_kernel, _forward_short_bags_kernel, _hash_starts_kernel, _input_summary_kernel)
from robe_torchrec.ops.triton.hash import _block_starts_kernel  # noqa: F401
from robe_torchrec.ops.triton.optimizers import (  # noqa: F401
    _optimizer_kernel, _rowwise_adagrad_kernel)
from robe_torchrec.ops.long_lived import long_lived
from robe_torchrec.ops.small_copies import ints_on_device
from robe_torchrec.ops.tiles import Tiles, bag_lengths, next_pow2
from robe_torchrec.ops.triton_launch import CachedLaunch
from robe_torchrec.ops.tuning import TritonTuning, current as current_tuning
from robe_torchrec.ops.validation import (IdCheck, check_backward_layout, check_data,
                                          check_data_summarized, check_grad_rows,
                                          check_layout, check_optimizer_args,
                                          check_output_size, check_rate, checked_batch,
                                          meta_facts)
from robe_torchrec.ops.weak_ids import WeakIdDict

#: test hook: fill buffers allocated with ``torch.empty`` with NaN before kernels write them
POISON_EMPTY = os.environ.get("ROBE_TRITON_POISON", "0") == "1"

_OPTIM_BLOCK = 1024
_SUMMARY_BLOCK = 1024


def _is_interpreted(module) -> bool:
    return type(module._forward_kernel).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set
    before triton was first imported), which CPU tensors need."""
    return _is_interpreted(sys.modules[__name__])


class _NoLaunch:
    """A kernel whose launches do nothing: ``kernel[grid](*args)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


#: what :func:`_kernels_for` returns while :func:`stubbed_launches` or
#: :func:`launch_on_cpu_tensors` is active
_launch_override = None
#: the kernels of :func:`stubbed_launches`, made at its first use
_NO_LAUNCHES = None


@contextlib.contextmanager
def stubbed_launches():
    """Inside the block every kernel launch of these ops does nothing, on any device (CPU
    tensors then need no interpreter): a call does all of its host work (checks, launch
    plan, allocations, dispatch) and none on the device, so its outputs hold garbage. For
    benchmarks of the host's time per call; Triton's launcher is what is left out."""
    global _launch_override, _NO_LAUNCHES
    previous = _launch_override
    if _NO_LAUNCHES is None:
        module = sys.modules[__name__]
        _NO_LAUNCHES = types.SimpleNamespace(**{name: _NoLaunch() for name in dir(module)
                                                if name.endswith("_kernel")})
    _launch_override = _NO_LAUNCHES
    try:
        yield
    finally:
        _launch_override = previous


@contextlib.contextmanager
def launch_on_cpu_tensors():
    """Inside the block CPU tensors get the launches of CUDA ones (compiled kernels, cached
    launches): for a stand-in driver that compiles and records launches instead of making
    them (:mod:`robe_torchrec.testing.recorded_launches`); a real one would take host
    pointers for device pointers."""
    if interpreted():
        raise RuntimeError("robe: launch_on_cpu_tensors needs compiled kernels: unset "
                           "TRITON_INTERPRET before triton is first imported")
    global _launch_override
    previous = _launch_override
    _launch_override = _cached_launches()
    try:
        yield
    finally:
        _launch_override = previous


def _kernels_for(device: torch.device):
    """The kernels, as attributes, once checked that they can run on ``device``: on CUDA
    each wrapped in a :class:`~robe_torchrec.ops.triton_launch.CachedLaunch` (the launch
    without ``JITFunction.run``'s per-call work), under the interpreter this module.

    Triton decides when a kernel is decorated (at import) whether it is compiled or
    interpreted (``TRITON_INTERPRET``), and ``triton.language`` itself is imported one way or
    the other; a process cannot mix the two reliably. So CPU tensors need the whole process
    in interpreter mode: ``TRITON_INTERPRET=1`` set before triton is first imported.
    """
    if _launch_override is not None:
        return _launch_override
    if _TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            "robe: the Triton kernels need the `triton` package, which failed to import "
            f"({_TRITON_IMPORT_ERROR}); install triton or use another backend"
        )
    module = sys.modules[__name__]
    if device.type == "cuda":
        return _cached_launches()
    if device.type == "cpu" and _is_interpreted(module):
        return module
    raise RuntimeError(
        f"robe: the Triton kernels run on CUDA tensors, or on CPU tensors under Triton's "
        f"interpreter (set TRITON_INTERPRET=1 before triton is first imported); got "
        f"{device.type} tensors with the kernels compiled"
    )


#: every kernel of this module wrapped in a CachedLaunch, made at the first CUDA call
_CACHED_LAUNCHES = None


def _cached_launches() -> types.SimpleNamespace:
    global _CACHED_LAUNCHES
    if _CACHED_LAUNCHES is None:
        module = sys.modules[__name__]
        _CACHED_LAUNCHES = types.SimpleNamespace(**{
            name: CachedLaunch(getattr(module, name)) for name in dir(module)
            if name.endswith("_kernel")})
    return _CACHED_LAUNCHES


def _acc_dtype(weights: torch.Tensor):
    return tl.float64 if m.accumulation_dtype(weights.dtype) == torch.float64 else tl.float32


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.contiguous()`` without its call when it already is (host time a launch)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: a Triton function, slow to call from the host
    return -(-a // b)


def _hash_args(hash_params: List[int]):
    if len(hash_params) != 3:
        raise ValueError(f"robe: hash_params must hold 3 ints, got {len(hash_params)}")
    return [to_signed64(int(p)) for p in hash_params]


#: (device, B, C, length) -> the reference hash's block terms on that device: made once,
#: shared by every plan that needs them
_BLOCK_TERMS: Dict[tuple, torch.Tensor] = {}


def _kernel_hash_args(hash_params: List[int], num_terms: int, device: torch.device) -> list:
    """The kernels' hash arguments ``[p0, terms]``: ``p0`` (A of the reference hash, the
    mix hash's salt) and the reference hash's block terms (:func:`reference_block_terms`,
    int32 on ``device``; the mix hash reads none). The terms are copied to the device once
    for all plans that use them: a plan for a new batch size reuses them, so that it can
    be made inside a CUDA graph capture, which refuses the copy."""
    params = _hash_args(hash_params)
    key = (device, params[1], params[2], num_terms)
    terms = _BLOCK_TERMS.get(key)
    if terms is None:
        if deferred_checks.is_capturing():
            raise RuntimeError(
                f"robe: the first call with these tables on {device} is inside a CUDA graph "
                "capture, which cannot copy their hash's block terms to the device; run one "
                "call outside the capture first (a warm-up step, as CUDA graphs need anyway)")
        host = torch.tensor(reference_block_terms(params, num_terms), dtype=torch.int32)
        # shared by later calls: made outside any CUDA graph pool (long_lived's docstring)
        terms = _BLOCK_TERMS[key] = long_lived(lambda: host.to(device), device)
    return [params[0], terms]


def _same_device(device: torch.device, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"robe: {name} is on {tensor.device} but weights are on {device}")


def _empty(*shape, dtype, device) -> torch.Tensor:
    out = torch.empty(*shape, dtype=dtype, device=device)
    if POISON_EMPTY:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


#: CPU table_meta -> (its version, its copy on the kernels' device)
_DEVICE_META: WeakIdDict = WeakIdDict()


def _meta_on(table_meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table_meta`` on the kernels' device, copied once per tensor version when the caller
    keeps it elsewhere (a copy per call would wait on the host, and break a graph capture)."""
    if table_meta.device == device:
        return _dense(table_meta)
    try:
        version = table_meta._version
    except RuntimeError:  # an inference tensor has no version to key a copy on: copy it,
        # from pinned memory (no wait for the device)
        return ints_on_device(table_meta.reshape(-1).tolist(), table_meta.dtype,
                              device).view(table_meta.shape)
    hit = _DEVICE_META.get(table_meta)
    if hit is not None and hit[0] == version and hit[1].device == device:
        return hit[1]
    if deferred_checks.is_capturing():
        raise RuntimeError(
            f"robe: table_meta is on {table_meta.device} and its copy on {device} is made "
            "inside a CUDA graph capture, which cannot copy it; keep it on the weights' "
            "device, or run one call with it outside the capture first (a warm-up, as CUDA "
            "graphs need anyway)")
    copy = long_lived(lambda: table_meta.to(device).contiguous(), device)  # kept: see there
    _DEVICE_META[table_meta] = (version, copy)
    return copy


def _key_limit_arg(id_check: IdCheck) -> int:
    return 0 if id_check.key_limit is None else min(id_check.key_limit, 2**63 - 1)


def _id_check_constants(id_check: IdCheck) -> dict:
    return dict(IN_BOUNDS=id_check.in_bounds,
                KEY_LIMIT=id_check.key_limit is not None and not id_check.in_bounds)


def _check_counts(device: torch.device) -> torch.Tensor:
    """Four zeroed counts for a kernel's input checks: a row never handed out before
    (:mod:`~robe_torchrec.ops.count_rows`, no device call), or ``torch.zeros`` where a row
    will not do (a CUDA graph capture, whose replays must zero their counts again)."""
    if count_rows.usable(device):
        return count_rows.zeroed_counts(device)
    return torch.zeros(count_rows.COUNTS, dtype=torch.int64, device=device)


def _launch_summary(values: torch.Tensor, offsets: torch.Tensor,
                    per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                    id_check: IdCheck) -> torch.Tensor:
    """The data-dependent input checks in one launch: four problem counts on the device
    (see :func:`robe_torchrec.ops.validation.check_inputs`)."""
    kernels = _kernels_for(values.device)
    num_bags = offsets.numel() - 1
    num_features = table_meta.shape[1]
    problems = _check_counts(values.device)
    programs = _cdiv(max(values.numel(), num_bags, 1), _SUMMARY_BLOCK)
    psw = per_sample_weights
    kernels._input_summary_kernel[(programs,)](
        values.contiguous(), offsets.contiguous(), values if psw is None else psw.contiguous(),
        _meta_on(table_meta, values.device), problems,
        values.numel(), num_bags, num_bags // num_features, num_features,
        _key_limit_arg(id_check), HAS_PSW=psw is not None, **_id_check_constants(id_check),
        SEARCH_STEPS=num_features.bit_length(), BLOCK=_SUMMARY_BLOCK,
    )
    return problems


def _answer(problems: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
            meta_cpu: torch.Tensor, id_check: IdCheck) -> bool:
    """Whether the inputs whose problems a kernel counted (``problems``, its four counts on
    the device) pass, read at once, or ``True`` with the answer queued for a later call
    (:mod:`robe_torchrec.ops.deferred_checks`). Either way the backward ops of the same
    inputs reuse it."""
    if deferred_checks.deferred_for(values.device):
        deferred_checks.submit(problems, values, offsets, per_sample_weights, table_meta,
                               meta_cpu, id_check)
        return True
    if problems.is_cuda:  # a later capture's checks add their replays' counts to it
        deferred_checks.prepare_tally(problems)
    clean = not any(problems.tolist())
    if clean:
        deferred_checks.remember_clean(values, offsets, per_sample_weights, meta_cpu,
                                       id_check)
    return clean


def _summarize_inputs(values: torch.Tensor, offsets: torch.Tensor,
                      per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                      meta_cpu: torch.Tensor, id_check: IdCheck) -> bool:
    """The summary kernel's answer (:func:`_answer`), for a forward whose kernel does not
    count the problems itself (see :func:`_counts_in_kernel`)."""
    deferred_checks.raise_ready()
    return _answer(_launch_summary(values, offsets, per_sample_weights, table_meta, id_check),
                   values, offsets, per_sample_weights, table_meta, meta_cpu, id_check)


def _counts_in_kernel(has_bags: bool, output_dim: int, facts) -> bool:
    """Whether the forward kernel counts the input checks' problems (one launch less): when
    it reads every id, that is when it runs at all (some bag, some column) and every
    feature has a column (and the tuning does not ask for the summary kernel)."""
    return (current_tuning().count_in_forward and has_bags and output_dim > 0
            and facts.min_dim > 0)


class _BackwardPlan(NamedTuple):
    """What a backward op derives on the host from its static layout, once per layout
    (:func:`_backward_plan`)."""
    meta_cpu: torch.Tensor
    id_check: IdCheck
    #: the kernels' hash arguments (:func:`_kernel_hash_args`)
    params: list
    tiles: "Tiles"
    #: some feature pools by its mean (the kernels then divide by the bag's size)
    mean: bool
    #: the scatter's launch (its guard added by each call)
    launch: "_BagLaunch"


def _backward_plan(grad_output, weights, values, offsets, psw, table_meta, block_size,
                   hash_mode, hash_params) -> _BackwardPlan:
    """The checked static layout of a backward call and its tiles, from the cache when an
    earlier call had the same layout, for every batch size (see :func:`_forward_plan`;
    :func:`_backward_checks` checks the output gradient's rows against the batch)."""
    tuning = current_tuning()
    key = ("backward", grad_output.dtype, grad_output.shape[1:], grad_output.device,
           *_tensor_facts(weights, values, offsets, psw, tuning), block_size, hash_mode,
           tuple(hash_params), tuning)

    def build() -> _BackwardPlan:
        _same_device(weights.device, grad_output=grad_output, values=values, offsets=offsets,
                     per_sample_weights=psw)
        meta_cpu, id_check = check_backward_layout(grad_output, weights, values, offsets, psw,
                                                   table_meta, block_size, hash_mode,
                                                   hash_params)
        facts = meta_facts(meta_cpu, block_size, grad_output.shape[1])
        tiles = Tiles(facts.max_dim, block_size, values.numel(), offsets.numel() - 1,
                       _is_interpreted(_kernels_for(weights.device)))
        launch = _bag_launch(tiles, facts.any_mean, weights, psw is not None, block_size,
                             hash_mode)
        return _BackwardPlan(meta_cpu, id_check,
                             _kernel_hash_args(hash_params, tiles.num_terms, weights.device),
                             tiles, facts.any_mean, launch)

    return _cached_plan(table_meta, key, build)


def _backward_checks(grad_output: torch.Tensor, weights: torch.Tensor, values: torch.Tensor,
                     offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                     table_meta: torch.Tensor, block_size: int, hash_mode: int,
                     hash_params: List[int]):
    """The backward ops' checks, without waiting for the device: ``(plan, guard)``.

    ``guard`` is ``None`` when the inputs are known to pass (a problem raises here), else
    four problem counts on the device that the backward's kernels read before writing
    anything (see :mod:`robe_torchrec.ops.deferred_checks`): the forward's, when it
    checked these same inputs, or the summary kernel's."""
    guards: List[Optional[torch.Tensor]] = []

    def summarize(values, offsets, per_sample_weights, table_meta, meta_cpu, id_check):
        deferred_checks.raise_ready()
        if deferred_checks.is_capturing():
            recorded = deferred_checks.recorded_guard(values.device)
            if recorded is not None:  # (under the graph trees: what the replays tallied)
                guards.append(recorded)
                return True
        earlier = deferred_checks.earlier_check(values, offsets, per_sample_weights, meta_cpu,
                                                id_check)
        # inside a capture only a check captured with it guards the replays (an eager
        # call's counts are no replay's)
        if earlier is not None and (earlier.captured or not deferred_checks.is_capturing()):
            guards.append(earlier.guard())
            return True
        problems = _launch_summary(values, offsets, per_sample_weights, table_meta, id_check)
        if deferred_checks.deferred_for(values.device):
            deferred_checks.submit(problems, values, offsets, per_sample_weights, table_meta,
                                   meta_cpu, id_check)
            guards.append(problems)
            return True
        return not any(problems.tolist())  # read at once; bad input raises its message

    plan = _backward_plan(grad_output, weights, values, offsets, per_sample_weights,
                          table_meta, block_size, hash_mode, hash_params)
    check_grad_rows(grad_output, checked_batch(offsets, table_meta.shape[1]))
    check_data_summarized(values, offsets, per_sample_weights, table_meta, plan.meta_cpu,
                          plan.id_check, summarize)
    return plan, (guards[0] if guards else None)


def _guard_args(guard: Optional[torch.Tensor], any_tensor: torch.Tensor):
    """The kernels' guard argument and constant (any pointer will do when unguarded)."""
    return (any_tensor if guard is None else guard,), dict(GUARDED=guard is not None)


class _ForwardPlan(NamedTuple):
    """What a forward derives on the host from its static layout, computed once per layout
    (:func:`_forward_plan`)."""
    meta_cpu: torch.Tensor
    id_check: IdCheck
    #: the kernels' hash arguments (:func:`_kernel_hash_args`)
    params: list
    counted: bool
    covers_output: bool
    launch: "_BagLaunch"
    key_limit: int


#: table_meta -> (its version, {everything else a plan depends on: plan}); weak keys, so a
#: module's plan lives as long as its table_meta
_PLANS: WeakIdDict = WeakIdDict()


def _forward_plan(weights, values, offsets, psw, table_meta, output_dim, block_size,
                  hash_mode, hash_params, bounds_check) -> _ForwardPlan:
    """The checked static layout of a forward call and its launch parameters, from the cache
    when an earlier call had the same layout: the same ``table_meta`` (and version), the same
    dtypes, devices and scalar arguments, the same tuning, and of the batch only what picks
    the tiles (see :func:`_tensor_facts`). A module calls with the same layout every step,
    and re-deriving it is most of a GPU forward's host time. What the batch size changes
    (its checks, the output's shape, the grid) each call works out itself, a few integer
    operations: the padded batch of an unpooled lookup or of a variable batch per feature
    has another size nearly every call."""
    tuning = current_tuning()
    key = (*_tensor_facts(weights, values, offsets, psw, tuning), output_dim, block_size,
           hash_mode, tuple(hash_params), bounds_check, tuning)

    def build() -> _ForwardPlan:
        kernels = _kernels_for(weights.device)
        _same_device(weights.device, values=values, offsets=offsets, per_sample_weights=psw)
        meta_cpu, id_check = check_layout(weights, values, offsets, psw, table_meta, output_dim,
                                          block_size, hash_mode, hash_params, bounds_check)
        num_bags = offsets.numel() - 1
        facts = meta_facts(meta_cpu, block_size, output_dim)
        counted = _counts_in_kernel(num_bags > 0, output_dim, facts)
        tiles = Tiles(facts.max_dim, block_size, values.numel(), num_bags,
                       _is_interpreted(kernels))
        if counted:
            check_constants = dict(CHECK=True, **_id_check_constants(id_check))
            key_limit = _key_limit_arg(id_check)
        else:  # the kernel never touches the problem counts
            check_constants, key_limit = dict(CHECK=False, IN_BOUNDS=False, KEY_LIMIT=False), 0
        launch = _bag_launch(tiles, facts.any_mean, weights, psw is not None, block_size,
                             hash_mode, check_constants)
        return _ForwardPlan(meta_cpu, id_check,
                            _kernel_hash_args(hash_params, tiles.num_terms, weights.device),
                            counted, facts.covers_output, launch, key_limit)

    return _cached_plan(table_meta, key, build)


def _tensor_facts(weights, values, offsets, psw, tuning: TritonTuning) -> tuple:
    """What a plan depends on in a call's tensors: their dtypes, devices, the weights'
    shape, but of the numbers of ids and bags only the bag lengths (:func:`bag_lengths`)
    and whether there is a bag, and whether the per-sample weights match the ids. Bags of
    several ids hold more or fewer in all every batch; a plan made again for each took 16
    of a 40 us forward's host time on a CPU core."""
    num_bags = offsets.numel() - 1
    return (weights.dtype, weights.shape, weights.device, values.dtype, values.dim(),
            values.device, offsets.dtype, offsets.dim(), num_bags > 0, offsets.device,
            bag_lengths(values.numel(), num_bags, tuning),
            None if psw is None else (psw.dtype, psw.shape == values.shape, psw.device))


def _cached_plan(table_meta: torch.Tensor, key: tuple, build):
    """``build()``, remembered under ``table_meta`` (its version) and ``key``: a module
    calls with the same layout every step. An inference ``table_meta`` has no version to key
    on, so its plan is built every time."""
    try:
        version = table_meta._version
    except RuntimeError:
        return build()
    entry = _PLANS.get(table_meta)
    # a write to table_meta (a new version) outdates every plan made from it
    plans = entry[1] if entry is not None and entry[0] == version else None
    plan = None if plans is None else plans.get(key)
    if plan is None:
        plan = build()
        if plans is None:
            plans = {}
            _PLANS[table_meta] = (version, plans)
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return plan


#: plans kept per table_meta (the layouts and tunings a module sees; beyond, start over)
_MAX_PLANS = 32


def forward(
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    output_dim: int,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    bounds_check: int,
) -> torch.Tensor:
    device = weights.device  # (a new object at every read)
    kernels = _kernels_for(device)
    psw = per_sample_weights
    plan = _forward_plan(weights, values, offsets, psw, table_meta, output_dim, block_size,
                         hash_mode, hash_params, bounds_check)
    batch = checked_batch(offsets, table_meta.shape[1])
    check_output_size(batch, output_dim)
    meta_cpu, id_check = plan.meta_cpu, plan.id_check
    if not plan.counted and not _summarize_inputs(values, offsets, psw, table_meta, meta_cpu,
                                                  id_check):
        check_data(values, offsets, psw, table_meta, meta_cpu, id_check)  # raises
    # columns no feature covers (output_dim > sum of dims) must read 0
    shape, dtype = (batch, output_dim), m.accumulation_dtype(weights.dtype)
    out = (_empty(*shape, dtype=dtype, device=device) if plan.covers_output
           else torch.zeros(shape, dtype=dtype, device=device))
    if batch == 0 or output_dim == 0:
        return out
    if plan.counted:
        deferred_checks.raise_ready()
        problems = _check_counts(device)
        check_args = (problems, plan.key_limit)
    else:  # any pointer will do
        check_args = (out, 0)
    _launch_bag_kernel((kernels._forward_kernel, kernels._forward_short_bags_kernel),
                       plan.launch, weights, weights, out, values, offsets, psw, table_meta,
                       output_dim, block_size, hash_mode, plan.params, check_args)
    # bad input made the kernel compute a wrong output but touch nothing outside its
    # tensors; the problem is raised here, or by a later call when the checks are deferred
    if plan.counted and not _answer(problems, values, offsets, psw, table_meta, meta_cpu,
                                    id_check):
        check_data(values, offsets, psw, table_meta, meta_cpu, id_check)  # raises
    return out


class _BagLaunch(NamedTuple):
    """A bag kernel's launch as far as its plan fixes it (:func:`_bag_launch`): all but the
    grid, which each call's number of bags sets (:func:`_launch_bag_kernel`)."""
    tiles: "Tiles"
    #: every constant of the launch but those a call adds (a backward's guard)
    constants: dict


def _bag_launch(tiles: "Tiles", mean: bool, weights: torch.Tensor, has_psw: bool,
                block_size: int, hash_mode: int,
                extra_constants: Optional[dict] = None) -> _BagLaunch:
    """The launch of the bag kernels ``tiles`` picks: the short-bags variant (several short
    bags a program) when ``tiles`` says the bags are short, else the one-bag-a-program
    variant; ``mean``: some feature pools by its mean (else the kernel is compiled without
    the division). Made once per plan: building the constants at every call was host time
    a forward waits on."""
    constants = dict(Z=block_size, HASH_MODE=int(hash_mode), HAS_PSW=has_psw,
                     ACC=_acc_dtype(weights), BLOCK_B=tiles.block_b, BLOCK_Z=tiles.block_z,
                     COMPACT=tiles.compact_hash, MEAN=mean, **(extra_constants or {}))
    if tiles.short_bags:
        constants.update(BLOCK_BAGS=tiles.block_bags, num_warps=tiles.short_bags_warps)
    else:
        constants.update(BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                         STARTS=tiles.two_pass, NUM_BLOCKS=tiles.num_blocks)
    return _BagLaunch(tiles, constants)


def _launch_bag_kernel(variants, launch: _BagLaunch, source: torch.Tensor,
                       weights: torch.Tensor, target: torch.Tensor, values: torch.Tensor,
                       offsets: torch.Tensor,
                       per_sample_weights: Optional[torch.Tensor], table_meta: torch.Tensor,
                       width: int, block_size: int, hash_mode: int, params: list,
                       extra_args: tuple = (), extra_constants: Optional[dict] = None) -> None:
    """Launch a bag kernel that reads ``source`` (weights, or the output gradient of ``width``
    columns) and writes ``target``: ``variants[1]`` (several short bags a program) or
    ``variants[0]`` (one bag a program), as ``launch`` says. ``extra_args`` are the forward
    kernels' check arguments or the backward's guard, ``extra_constants`` the constants the
    call adds to ``launch``'s (the backward's guard)."""
    num_features = table_meta.shape[1]
    num_bags = offsets.numel() - 1
    batch = num_bags // num_features
    psw = per_sample_weights
    args = (_dense(source), _dense(values), _dense(offsets),
            weights if psw is None else _dense(psw),
            _meta_on(table_meta, weights.device), target,
            batch, num_features, values.numel(), width, *params, *extra_args)
    constants = ({**launch.constants, **extra_constants} if extra_constants
                 else launch.constants)
    per_bag, short_bags = variants
    tiles = launch.tiles
    if tiles.short_bags:  # a program a group of a feature's bags and a column tile
        short_bags[num_features * _cdiv(batch, tiles.block_bags), tiles.col_tiles](
            *args, **constants)
        return
    starts = _hash_starts(values, offsets, table_meta, batch, block_size, hash_mode, params,
                          tiles, weights) if tiles.two_pass else values
    per_bag[num_bags, tiles.col_tiles](*args, starts, **constants)


def _hash_starts(values: torch.Tensor, offsets: torch.Tensor, table_meta: torch.Tensor,
                 batch: int, block_size: int, hash_mode: int, params: list, tiles: Tiles,
                 weights: torch.Tensor) -> torch.Tensor:
    """Every id's block starts, ``[num_values, tiles.num_blocks]``, hashed once (the first
    pass of a two-pass launch): int32 while every start fits, else int64."""
    kernels = _kernels_for(values.device)
    num_blocks = tiles.num_blocks
    fits = weights.numel() < 2**31  # every start lies below it
    starts = _empty(values.numel(), num_blocks, dtype=torch.int32 if fits else torch.int64,
                    device=values.device)
    num_bags = offsets.numel() - 1
    block_nb = next_pow2(num_blocks)
    kernels._hash_starts_kernel[(num_bags,)](
        values.contiguous(), offsets.contiguous(), _meta_on(table_meta, values.device), starts,
        batch, table_meta.shape[1], values.numel(), *params, Z=block_size,
        HASH_MODE=int(hash_mode), NUM_BLOCKS=num_blocks,
        BLOCK_N=max(1, min(tiles.block_n, 1024 // block_nb)), BLOCK_NB=block_nb,
    )
    return starts


def hash_starts(weights: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                table_meta: torch.Tensor, max_dim: int, block_size: int, hash_mode: int,
                hash_params: List[int]) -> torch.Tensor:
    """Every id's block starts (``[num_values, ceil(max_dim / block_size)]``), as the first
    pass of a two-pass forward stores them; no input checks. For benchmarks and tests."""
    tiles = Tiles(max_dim, block_size, values.numel(), offsets.numel() - 1,
                   _is_interpreted(_kernels_for(values.device)))
    batch = (offsets.numel() - 1) // table_meta.shape[1]
    return _hash_starts(values, offsets, table_meta, batch, block_size, hash_mode,
                        _kernel_hash_args(hash_params, tiles.num_terms, values.device), tiles,
                        weights)


def forward_from_starts(weights: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                        table_meta: torch.Tensor, output_dim: int, max_dim: int,
                        block_size: int, starts: torch.Tensor) -> torch.Tensor:
    """The second pass of a two-pass forward alone: the bags pooled from block starts
    computed beforehand (:func:`hash_starts`), no hash, no input checks, every bag summed
    (whatever pooling ``table_meta`` gives it). What reading the touched blocks and
    pooling them costs: a floor for benchmarks (never for untrusted input)."""
    kernels = _kernels_for(weights.device)
    num_bags = offsets.numel() - 1
    batch = num_bags // table_meta.shape[1]
    tiles = Tiles(max_dim, block_size, values.numel(), num_bags, _is_interpreted(kernels))
    out = torch.zeros(batch, output_dim, dtype=m.accumulation_dtype(weights.dtype),
                      device=weights.device)
    kernels._forward_kernel[(num_bags, tiles.col_tiles)](
        weights, values, offsets, weights, _meta_on(table_meta, weights.device), out, batch,
        table_meta.shape[1], values.numel(), output_dim, 0, out, out, 0, starts,
        Z=block_size, HASH_MODE=0, HAS_PSW=False, ACC=_acc_dtype(weights), CHECK=False,
        IN_BOUNDS=False, KEY_LIMIT=False, STARTS=True, NUM_BLOCKS=tiles.num_blocks,
        COMPACT=False, MEAN=False, **tiles.kwargs())
    return out


def _scatter_gradient(grad_output, weights, values, offsets, per_sample_weights, table_meta,
                      block_size, hash_mode, hash_params):
    """Checks, then the dense weight gradient in the accumulation dtype (fp32 / fp64), and
    the guard the checks left (see :func:`_backward_checks`): all zeros if it fails."""
    kernels = _kernels_for(weights.device)
    plan, guard = _backward_checks(grad_output, weights, values, offsets, per_sample_weights,
                                   table_meta, block_size, hash_mode, hash_params)
    output_dim = grad_output.shape[1]
    params, tiles = plan.params, plan.tiles
    acc = m.accumulation_dtype(weights.dtype)
    grad = torch.zeros(weights.shape, dtype=acc, device=weights.device)  # atomics add into it
    if values.numel() == 0:
        return grad, guard
    guard_args, guard_constants = _guard_args(guard, grad)
    if _deterministic_scatter(weights.device):
        _gather_gradient(grad, grad_output, values, offsets, per_sample_weights, table_meta,
                         block_size, hash_mode, params, tiles, guard_args, guard_constants)
        return grad, guard
    _launch_bag_kernel((kernels._backward_kernel, kernels._backward_short_bags_kernel),
                       plan.launch, grad_output, weights, grad, values, offsets,
                       per_sample_weights, table_meta, output_dim, block_size, hash_mode,
                       params, guard_args, guard_constants)
    return grad, guard


def _deterministic_scatter(device: torch.device) -> bool:
    """Whether the weight gradient is summed in a fixed order (:func:`_gather_gradient`)
    instead of with float atomics: on CUDA under ``torch.use_deterministic_algorithms``,
    or anywhere when the tuning asks for it (tests; the interpreter's atomics run in order
    anyway)."""
    return current_tuning().deterministic_backward or (
        device.type == "cuda" and torch.are_deterministic_algorithms_enabled())


#: pairs whose block has no column (a feature narrower than the widest) sort past every tile
_NO_KEY = 2**62
#: elements of the weight gradient a gather program owns
_GATHER_TILE = 128


def _gather_gradient(grad: torch.Tensor, grad_output: torch.Tensor, values: torch.Tensor,
                     offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                     table_meta: torch.Tensor, block_size: int, hash_mode: int,
                     params: list, tiles: Tiles, guard_args: tuple,
                     guard_constants: dict) -> None:
    """The weight gradient into ``grad``, the same sums as the atomic kernels but in an
    order fixed by the inputs alone, so that two runs agree bit for bit: every (id, block)
    pair's block start hashed once (the two-pass forward's first pass), the pairs sorted by
    the first element their block writes (stable: ties in pair order), then one program a
    tile of ``grad`` adds, pair after pair, the blocks that reach the tile. Every step is
    deterministic on CUDA (a stable sort, binary searches, elementwise ops), none waits for
    the device, and each pair's contribution is the one the atomic kernels add."""
    device = grad.device
    num_features = table_meta.shape[1]
    num_bags = offsets.numel() - 1
    if num_bags == 0:  # no bag holds an id (bad offsets the guard reports): no gradient
        return
    batch = num_bags // num_features
    num_blocks = tiles.num_blocks
    meta = _meta_on(table_meta, device)
    starts = _hash_starts(values, offsets, table_meta, batch, block_size, hash_mode, params,
                          tiles, grad)
    # each id's bag; offsets already checked, or the guard discards what bad ones give
    bounds = offsets.to(torch.int64)
    position = torch.arange(values.numel(), device=device)
    bag = torch.searchsorted(bounds[1:], position, right=True).clamp_(max=max(num_bags - 1, 0))
    feature = bag // max(batch, 1)
    first_col = torch.arange(num_blocks, device=device) * block_size
    lanes = (meta[m.DIM][feature][:, None] - first_col).clamp_(max=block_size)
    keys = torch.where(lanes > 0, meta[m.W_OFFSET][feature][:, None] + starts, _NO_KEY)
    grad_output = _dense(grad_output)
    row = (bag - feature * batch) * grad_output.shape[1] + meta[m.OUT_OFFSET][feature]
    src = row[:, None] + first_col
    size = (bounds[bag + 1] - bounds[bag]).clamp_(min=1)
    mean = meta[m.POOLING][feature] == int(m.Pooling.MEAN)
    divisor = torch.where(mean, size, 1).to(grad.dtype)
    sorted_keys, order = torch.sort(keys.view(-1), stable=True)
    num_tiles = _cdiv(grad.numel(), _GATHER_TILE)
    tile_start = torch.arange(num_tiles, device=device) * _GATHER_TILE
    pair_bounds = torch.searchsorted(
        sorted_keys, torch.cat([tile_start - (block_size - 1), tile_start + _GATHER_TILE]))
    psw = per_sample_weights
    _kernels_for(device)._gather_gradient_kernel[(num_tiles,)](
        grad_output, grad_output if psw is None else _dense(psw), sorted_keys, order, src,
        lanes, divisor, pair_bounds, grad, grad.numel(), num_tiles, *guard_args,
        NUM_BLOCKS=num_blocks, HAS_PSW=psw is not None, ACC=_acc_dtype(grad),
        TILE=_GATHER_TILE, **guard_constants)


def backward_dense(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    grad, _ = _scatter_gradient(grad_output, weights, values, offsets, per_sample_weights,
                                table_meta, block_size, hash_mode, hash_params)
    return grad.to(weights.dtype)


def per_sample_weights_grad(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
) -> torch.Tensor:
    kernels = _kernels_for(weights.device)
    plan, guard = _backward_checks(grad_output, weights, values, offsets, None, table_meta,
                                   block_size, hash_mode, hash_params)
    num_features = table_meta.shape[1]
    num_bags = offsets.numel() - 1
    batch = num_bags // num_features
    output_dim = grad_output.shape[1]
    params, tiles = plan.params, plan.tiles
    # every value lies in exactly one bag (offsets were checked), so every entry is written
    out = _empty(values.numel(), dtype=weights.dtype, device=weights.device)
    if values.numel() == 0:
        return out
    guard_args, guard_constants = _guard_args(guard, out)
    kernels._psw_grad_kernel[(num_bags,)](
        grad_output.contiguous(), weights.contiguous(), values.contiguous(),
        offsets.contiguous(), _meta_on(table_meta, weights.device), out,
        batch, num_features, values.numel(), output_dim, *params, *guard_args,
        Z=block_size, HASH_MODE=int(hash_mode), ACC=_acc_dtype(weights), MEAN=plan.mean,
        **tiles.kwargs(), **guard_constants,
    )
    return out


def backward_fused_(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    optimizer: int,
    hparams: List[float],
    step: int,
    lr: Optional[torch.Tensor] = None,
) -> None:
    """Scatter the gradient into ``weights`` and apply the optimizer in place; ``step`` is
    the 1-based number of this update, Adam's bias correction computed from it here; ``lr``
    (one float on the weights' device), where given, the rate the kernel reads in place of
    ``hparams[0]``."""
    optimizer = int(optimizer)
    if optimizer == m.Optimizer.ADAM and deferred_checks.is_capturing():
        raise ValueError("robe: fused Adam cannot be captured in a CUDA graph with its step "
                         "on the host: its bias correction depends on the step, which a "
                         "replay would repeat; pass capturable=True to torch.optim.Adam (the "
                         "step is then counted on the device, each replay takes the next), "
                         "or leave the backward out of the graph")
    _fused_update(grad_output, weights, state1, state2, values, offsets, per_sample_weights,
                  table_meta, block_size, hash_mode, hash_params, optimizer, hparams, step, lr)


def counted_backward_fused_(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor,
    step: Optional[torch.Tensor],
    optimizer: int,
    hparams: List[float],
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    table_meta: torch.Tensor,
    block_size: int,
    hash_mode: int,
    hash_params: List[int],
    lr: Optional[torch.Tensor] = None,
) -> None:
    """``robe::counted_backward_fused_`` for a step count kept on the weights' device (a
    capturable optimizer's; ``None``: an optimizer without one, the count is 1).

    The count is advanced by a tensor op and read by the optimizer kernel, never by the
    host: nothing waits for the device, and a CUDA graph that captured this call takes
    the next step at each replay (Adam included, which :func:`backward_fused_` refuses
    to capture). The count advances only when the update is made: not when a check raises,
    nor when a guard (a deferred check not read yet) stops the kernels' writes."""
    if step is None:
        backward_fused_(grad_output, weights, state1, state2, values, offsets,
                        per_sample_weights, table_meta, block_size, hash_mode, hash_params,
                        optimizer, hparams, 1, lr)
        return
    _check_device_step(step, weights)
    _fused_update(grad_output, weights, state1, state2, values, offsets, per_sample_weights,
                  table_meta, block_size, hash_mode, hash_params, int(optimizer), hparams, step,
                  lr)


def _check_device_step(step: torch.Tensor, weights: torch.Tensor) -> None:
    """A device step count is one number on the weights' device."""
    _same_device(weights.device, step=step)
    if step.numel() != 1:
        raise ValueError(f"robe: the step count must hold one number, got shape "
                         f"{tuple(step.shape)}")


def _adam_step_args(optimizer: int, beta1: float, beta2: float, step):
    """The optimizer kernel's ``(bias1, bias2_sqrt, beta1)`` and its ``STEP_ON_DEVICE``:
    Adam's bias corrections computed here from an int ``step``, or left to the kernel,
    which reads a step tensor."""
    on_device = optimizer == m.Optimizer.ADAM and isinstance(step, torch.Tensor)
    bias1, bias2_sqrt = 1.0, 1.0
    if optimizer == m.Optimizer.ADAM and not on_device:
        bias1 = 1.0 - beta1 ** step
        bias2_sqrt = math.sqrt(1.0 - beta2 ** step)
    return (bias1, bias2_sqrt, beta1), dict(STEP_ON_DEVICE=on_device)


def _fused_update(grad_output, weights, state1, state2, values, offsets, per_sample_weights,
                  table_meta, block_size, hash_mode, hash_params, optimizer: int,
                  hparams: List[float], step, lr: Optional[torch.Tensor]) -> None:
    """The fused backward's checks, scatter and optimizer launch; ``step`` is the int
    count of this update, or a tensor on the weights' device that holds the previous one
    (advanced here once every check has passed, and taken back by the kernel when a guard
    stops its writes); ``lr`` the rate tensor the kernel reads, or None (``hparams[0]``)."""
    # the gradient goes to a buffer of its own: bad optimizer arguments raise below, before
    # weights or state change; the layout (block_size included) is checked first, as the
    # reference does
    grad, guard = _scatter_gradient(grad_output, weights, values, offsets, per_sample_weights,
                                    table_meta, block_size, hash_mode, hash_params)
    # a device count is not read here (that would wait for the device): it is >= 1 once
    # advanced from a count that started at 0
    host_step = 1 if isinstance(step, torch.Tensor) else step
    check_optimizer_args(weights, state1, state2, optimizer, hparams, host_step, block_size)
    check_rate(lr, weights)
    kernels = _kernels_for(weights.device)
    rate, eps, beta1, beta2, weight_decay = (float(h) for h in hparams)
    counted = isinstance(step, torch.Tensor)
    numel = weights.numel()
    if numel == 0:
        if counted:  # nothing to update, nothing to guard
            step += 1
        return
    guard_args, guard_constants = _guard_args(guard, grad)
    # a scalar rate or an int step reads no pointer: any will do
    rate_ptr = grad if lr is None else lr
    step_ptr = step if counted else grad
    undo_step = counted and guard is not None
    if counted:  # every check passed: counted just before the launch that may take it back
        step += 1
    if optimizer == m.Optimizer.ROWWISE_ADAGRAD:
        num_rows = state1.numel()
        block_z = next_pow2(block_size)
        rows = max(1, _OPTIM_BLOCK // block_z)
        kernels._rowwise_adagrad_kernel[(_cdiv(num_rows, rows),)](
            weights, grad, state1, numel, num_rows, rate, eps, weight_decay, step_ptr,
            rate_ptr, *guard_args, Z=block_size, HAS_WEIGHT_DECAY=weight_decay != 0.0,
            COMPUTE=_acc_dtype(weights), RATE_ON_DEVICE=lr is not None, UNDO_STEP=undo_step,
            ROWS=rows, BLOCK_Z=block_z, **guard_constants,
        )
        return
    uses = {m.Optimizer.SGD: 0, m.Optimizer.ADAGRAD: 1, m.Optimizer.ADAM: 2}[optimizer]
    step_args, step_constants = _adam_step_args(optimizer, beta1, beta2, step)
    kernels._optimizer_kernel[(_cdiv(numel, _OPTIM_BLOCK),)](
        weights, grad, state1 if uses >= 1 else weights, state2 if uses >= 2 else weights, numel,
        rate, eps, beta2, weight_decay, 1.0 - beta1, *step_args, step_ptr, rate_ptr,
        *guard_args, OPTIMIZER=optimizer, HAS_WEIGHT_DECAY=weight_decay != 0.0,
        COMPUTE=_acc_dtype(weights), GUARDED=guard_constants["GUARDED"],
        RATE_ON_DEVICE=lr is not None, UNDO_STEP=undo_step, BLOCK=_OPTIM_BLOCK,
        **step_constants,
    )


def block_starts(keys: torch.Tensor, num_blocks: int, memory_size: int, block_size: int,
                 mode: int, params: List[int]) -> torch.Tensor:
    """``[N, num_blocks]`` block starts computed by the kernels' hash helpers; the Triton twin
    of :func:`robe_torchrec.hashing.block_starts` (scalar ``memory_size``), for tests."""
    kernels = _kernels_for(keys.device)
    keys = keys.to(torch.int64).contiguous()
    out = _empty(keys.numel(), num_blocks, dtype=torch.int64, device=keys.device)
    if keys.numel() == 0 or num_blocks == 0:
        return out
    block_k = 64
    kernels._block_starts_kernel[(_cdiv(keys.numel(), block_k),)](
        keys, out, keys.numel(), int(memory_size) - int(block_size) + 1,
        *_kernel_hash_args(params, next_pow2(num_blocks), keys.device),
        NUM_BLOCKS=int(num_blocks), HASH_MODE=int(mode), BLOCK_K=block_k,
        BLOCK_B=next_pow2(num_blocks),
    )
    return out
