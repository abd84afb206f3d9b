"""Which ``fbgemm::`` ops a piece of code calls: :class:`FbgemmOpRecorder`, a
``TorchDispatchMode`` that notes every op of that namespace reaching the dispatcher.

How the shim's op list (:data:`robe_torchrec.testing.fbgemm_cuda_shim.SHIMMED_OPS`) was
found: KJT handling, DMP (data-parallel and table-wise), the pipelines and the app run on CPU
under it. ``run --cpu`` records again and reports any op the shim lacks, so a torchrec upgrade
that calls a new op shows up in CI (``with FbgemmOpRecorder() as rec: ...``, then ``rec.ops``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Set

from torch.utils._python_dispatch import TorchDispatchMode


class FbgemmOpRecorder(TorchDispatchMode):
    """Records the name of every ``fbgemm::`` op dispatched inside it (not those an fbgemm op
    calls from C++: they need no CUDA kernel of their own once the outer op has one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs: Optional[Dict[str, Any]] = None):
        if func.namespace == "fbgemm":
            self.ops.add(func._opname)
        return func(*args, **(kwargs or {}))
