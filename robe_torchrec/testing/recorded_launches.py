"""Triton launches without a GPU: compiled for sm_90 by a stand-in CUDA driver, recorded
instead of made.

Inside :func:`recorded_launches` Triton's active driver is a stand-in (device 0, an H100's
target, stream 0), so ``kernel[grid](...)`` binds, specialises and compiles exactly as on
that GPU (Triton ships ``ptxas``), and the compiled kernel's launcher, instead of calling
the CUDA driver, records what it was given. The ops' host wrappers run on CPU tensors
standing in for CUDA ones (``triton_kernels.launch_on_cpu_tensors``). What this shows: the
host's whole path down to Triton's C launcher (how long it takes, what it passes), and what
an H100 would refuse when loading or launching a kernel (shared memory, threads, grid
size); what it cannot: anything the device does.

Needs a process in which Triton is not interpreted (``TRITON_INTERPRET`` unset before the
first import of triton) and no real CUDA driver was used: Triton keeps per-device state
that the stand-in would share.

Example (a fresh process)::

    with recorded_launches() as launches, triton_kernels.launch_on_cpu_tensors():
        triton_kernels.forward(*case.forward_args())
    launches[0].name  # '_forward_short_bags_kernel'
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, List, Optional, Tuple

import torch

from triton.backends.compiler import GPUTarget
from triton.compiler import compiler
from triton.runtime import driver

#: the stand-in device's target: an H100
SM90 = GPUTarget("cuda", 90, 32)
#: the shared memory (bytes) a program may use, by compute capability (CUDA's tables:
#: A100, A10/L4-class, H100); every one of them gives a program 1024 threads
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
_MAX_THREADS = 1024
#: a grid's limits
_MAX_GRID = (2**31 - 1, 65535, 65535)


@dataclasses.dataclass
class Launch:
    """What a compiled kernel's launcher was given."""

    name: str
    #: the compiled variant (``CompiledKernel``): the same object for the same variant
    variant: object
    grid: Tuple[int, int, int]
    stream: int
    #: every kernel argument, constants included, in signature order
    args: tuple


class _StandInDriver:
    """The part of a Triton GPU driver that binding, compiling and launching read."""

    def get_current_target(self) -> GPUTarget:
        return SM90

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: Optional[int] = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


#: the list of the innermost active recorded_launches block, and whether it keeps launches
_recording: Optional[Tuple[List[Optional[Launch]], bool]] = None


def load_refusal(kernel) -> Optional[str]:
    """Why a GPU of the compute capability ``kernel`` (a ``CompiledKernel``) was compiled for
    would refuse to load it: more shared memory or threads than it gives a program; None if
    it would not."""
    target = kernel.metadata.target
    shared, warps = kernel.metadata.shared, kernel.metadata.num_warps
    limit = MAX_SHARED[target.arch]
    if shared > limit or warps * target.warp_size > _MAX_THREADS:
        return (f"{kernel.name} needs {shared} bytes of shared memory and {warps} warps: an "
                f"sm_{target.arch} GPU gives a program {limit} bytes and {_MAX_THREADS} "
                "threads")
    return None


def _init_handles(kernel) -> None:
    """``CompiledKernel._init_handles`` for the stand-in: refuse what loading the binary on
    its GPU would (:func:`load_refusal`), and give the kernel a launcher that records."""
    if kernel.module is not None:
        return
    refusal = load_refusal(kernel)
    if refusal:
        raise RuntimeError(refusal)

    def launcher(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
                 enter_hook, exit_hook, *args) -> None:
        if _recording is None:
            raise RuntimeError(f"{kernel.name} launched outside recorded_launches()")
        grid = (grid_x, grid_y, grid_z)
        if any(not 0 <= g <= limit for g, limit in zip(grid, _MAX_GRID)):
            raise RuntimeError(f"{kernel.name} launched on grid {grid}: CUDA allows at most "
                               f"{_MAX_GRID}")
        launches, keep = _recording
        launches.append(Launch(kernel.name, kernel, grid, stream, args) if keep else None)

    kernel.module, kernel.function, kernel._run = "stand-in", id(kernel), launcher


@contextlib.contextmanager
def recorded_launches(keep: bool = True) -> Iterator[List[Launch]]:
    """Inside the block Triton compiles for sm_90 and every launch is appended to the list
    yielded (``keep=False``: counted in its length only, as ``None``, for timing). A block
    inside another records into its own list and leaves the outer one's stand-in active."""
    global _recording
    previous_recording, launches = _recording, []
    previous_init = compiler.CompiledKernel._init_handles
    compiler.CompiledKernel._init_handles = _init_handles
    driver.set_active(_StandInDriver())
    _recording = (launches, keep)
    try:
        yield launches
    finally:
        _recording = previous_recording
        if previous_recording is None:  # the outermost block: Triton as it was
            compiler.CompiledKernel._init_handles = previous_init
            driver.set_active(None)  # Triton's default again, made when next needed
