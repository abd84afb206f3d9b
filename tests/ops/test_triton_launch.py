"""The cached launch's fallback, which needs no compiled kernel: where Triton's launcher
convention is not one it follows, every launch goes through the kernel's own ``[grid]``.
(The cached path itself is checked against ``JITFunction.run`` by
``tests/ops/cached_launches.py``, kernels compiled for sm_90 by a stand-in driver.)"""

from robe_torchrec.ops import triton_launch


class _Kernel:
    """Stands in for a ``JITFunction``: records its launches."""

    def __init__(self):
        self.launches = []
        self.pre_run_hooks = []

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launches.append((grid, args, constants))


def test_an_unsupported_triton_launches_every_time_through_the_kernel(monkeypatch):
    monkeypatch.setattr(triton_launch, "SUPPORTED", False)
    kernel = _Kernel()
    launch = triton_launch.CachedLaunch(kernel)
    for _ in range(2):
        launch[(3, 2)](1, 2.5, BLOCK=4)
    assert kernel.launches == [((3, 2), (1, 2.5), {"BLOCK": 4})] * 2
    assert launch.variants == 0
