"""CUDA kernels, in plain PyTorch, for the few ``fbgemm::`` sparse ops that TorchRec calls on
our paths, for machines with a CUDA torch but only the CPU build of FBGEMM (fbgemm-gpu-cpu).

Test-only: nothing in ``robe_torchrec`` or its pipelines loads it. A real CUDA FBGEMM already has these kernels, and :func:`install`
leaves any op that has a CUDA kernel alone, so loading it there changes nothing.

The ops (:data:`SHIMMED_OPS`) are what :class:`FbgemmOpRecorder` (below)
saw on CPU under torchrec 1.6.1 and 1.8.0: KJT offsets/lengths/permute/split/to_dict/concat and
KeyedTensor regroup; DMP data-parallel and table-wise on 1 and 2 ranks; the plain, SparseDist,
FusedSparseDist and SemiSync pipelines. Only ``asynchronous_complete_cumsum`` is reached by
the 1-rank pipelines; table-wise on more ranks adds ``permute_2D_sparse_data``, and
``KeyedTensor.regroup`` reaches ``permute_pooled_embs`` (through the autograd op
``permute_pooled_embs_auto_grad``, whose own kernel is device-independent).

Every kernel is written without host synchronisation where the op's arguments allow it
(output sizes come from the caller's ``*_sum`` hints when given), so that a pipeline's
streams are not serialised by the shim.

Example::

    >>> from robe_torchrec.testing import fbgemm_cuda_shim
    >>> fbgemm_cuda_shim.install()
    {'asynchronous_complete_cumsum': 'registered', ...}
    >>> kjt.to("cuda").offsets()      # fbgemm::asynchronous_complete_cumsum on CUDA
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_LIBRARY: Optional[torch.library.Library] = None
_STATUS: Dict[str, str] = {}


def asynchronous_complete_cumsum(t_in: Tensor) -> Tensor:
    """``[0, t0, t0+t1, ...]`` along the last dim (1-D or 2-D input), in the input's dtype."""
    if t_in.dim() not in (1, 2):
        raise RuntimeError(f"asynchronous_complete_cumsum: expected a 1-D or 2-D tensor, "
                           f"got {t_in.dim()}-D")
    zero = torch.zeros((*t_in.shape[:-1], 1), dtype=t_in.dtype, device=t_in.device)
    return torch.cat([zero, torch.cumsum(t_in, dim=-1, dtype=t_in.dtype)], dim=-1)


def _segment_gather_index(starts: Tensor, sizes: Tensor, total: int) -> Tensor:
    """For segments ``[starts[i], starts[i] + sizes[i])`` laid end to end: the source
    position of every output element (``total`` = ``sizes.sum()``, so no host sync)."""
    sizes = sizes.to(torch.int64)
    out_starts = torch.cumsum(sizes, 0) - sizes
    shift = torch.repeat_interleave(starts.to(torch.int64) - out_starts, sizes,
                                    output_size=total)
    return shift + torch.arange(total, dtype=torch.int64, device=starts.device)


def permute_2D_sparse_data(permute: Tensor, lengths: Tensor, values: Tensor,
                           weights: Optional[Tensor] = None,
                           permuted_lengths_sum: Optional[int] = None
                           ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """Reorder the feature rows of a ``[T, B]`` lengths tensor by ``permute`` (a row may be
    picked several times or not at all) and the values and weights with them."""
    permuted_lengths = lengths.index_select(0, permute.to(torch.int64))
    per_row = lengths.to(torch.int64).sum(dim=1)
    row_starts = torch.cumsum(per_row, 0) - per_row
    idx64 = permute.to(torch.int64)
    total = (int(permuted_lengths_sum) if permuted_lengths_sum is not None
             else int(per_row.index_select(0, idx64).sum()))  # host sync only without the hint
    index = _segment_gather_index(row_starts.index_select(0, idx64),
                                  per_row.index_select(0, idx64), total)
    permuted_values = values.index_select(0, index)
    permuted_weights = weights.index_select(0, index) if weights is not None else None
    return permuted_lengths, permuted_values, permuted_weights


def permute_pooled_embs(pooled_embs: Tensor, offset_dim_list: Tensor, permute_list: Tensor,
                        inv_offset_dim_list: Tensor, inv_permute_list: Tensor) -> Tensor:
    """The column blocks of ``pooled_embs`` (block ``i``: ``offset_dim_list[i]`` to
    ``[i + 1]``) laid out in the order ``permute_list``; the inverse lists are for the
    backward, which FBGEMM's autograd op computes with this same kernel."""
    del inv_offset_dim_list, inv_permute_list
    idx = permute_list.to(torch.int64)
    offsets = offset_dim_list.to(torch.int64)
    widths = (offsets[1:] - offsets[:-1]).index_select(0, idx)
    # the output has as many columns as the input: no host sync needed for the size
    index = _segment_gather_index(offsets[:-1].index_select(0, idx), widths,
                                  pooled_embs.shape[1])
    return pooled_embs.index_select(1, index)


#: op name -> its plain-PyTorch kernel
SHIMMED_OPS: Dict[str, Callable] = {
    "asynchronous_complete_cumsum": asynchronous_complete_cumsum,
    "permute_2D_sparse_data": permute_2D_sparse_data,
    "permute_pooled_embs": permute_pooled_embs,
}


def has_cuda_kernel(op: str) -> bool:
    """Whether ``fbgemm::<op>`` already runs on CUDA tensors (its own CUDA kernel, or a
    composite one that serves every backend)."""
    name = f"fbgemm::{op}"
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
               for key in ("CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd"))


def install() -> Dict[str, str]:
    """Register the CUDA kernel of every op in :data:`SHIMMED_OPS` that lacks one; FBGEMM's
    ops must be loaded first (this imports ``fbgemm_gpu``). Idempotent. Returns, per op,
    ``"registered"``, ``"has a CUDA kernel"`` or ``"not in this fbgemm"``."""
    global _LIBRARY
    import fbgemm_gpu  # noqa: F401 - defines the fbgemm:: ops

    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("fbgemm", "IMPL")
    for op, kernel in SHIMMED_OPS.items():
        if _STATUS.get(op) == "registered":
            continue
        if not torch._C._dispatch_has_kernel(f"fbgemm::{op}"):
            _STATUS[op] = "not in this fbgemm"
        elif has_cuda_kernel(op):
            _STATUS[op] = "has a CUDA kernel"
        else:
            _LIBRARY.impl(op, kernel, "CUDA")
            _STATUS[op] = "registered"
    return dict(_STATUS)


def installed(rank: int = 0, world_size: int = 1) -> Dict[str, str]:
    """This process's :func:`install` result so far (empty if it never ran); a
    ``run_ranks`` function, so a parent can ask a spawned rank whether it has the shim."""
    del rank, world_size
    return dict(_STATUS)


class FbgemmOpRecorder(TorchDispatchMode):
    """Records the name of every ``fbgemm::`` op dispatched inside it (not those an fbgemm op
    calls from C++: they need no CUDA kernel of their own once the outer op has one). How
    :data:`SHIMMED_OPS` was found, and how a torchrec upgrade that calls a new op shows up:
    ``with FbgemmOpRecorder() as rec: ...``, then ``rec.ops`` against the list."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs: Optional[Dict[str, Any]] = None):
        if func.namespace == "fbgemm":
            self.ops.add(func._opname)
        return func(*args, **(kwargs or {}))
