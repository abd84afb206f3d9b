"""The CUDA shim of FBGEMM's sparse ops (``robe_torchrec/testing/fbgemm_cuda_shim.py``),
checked on CPU tensors against fbgemm-gpu-cpu's own kernels: random inputs, several shapes,
empty ones included, bit for bit (every op only moves or adds integers, or copies floats)."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")

from robe_torchrec.testing import fbgemm_cuda_shim as shim  # noqa: E402

SEEDS = range(4)


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (513,), (3, 5), (4, 0), (0, 3)])
def test_complete_cumsum(dtype: torch.dtype, shape) -> None:
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 50, shape, generator=g, dtype=dtype)
        _same(shim.asynchronous_complete_cumsum(t),
              torch.ops.fbgemm.asynchronous_complete_cumsum(t))


def _sparse(T: int, B: int, max_len: int, g: torch.Generator, ldtype: torch.dtype,
            vdtype: torch.dtype, weighted: bool):
    lengths = torch.randint(0, max_len + 1, (T, B), generator=g, dtype=ldtype)
    n = int(lengths.sum())
    values = (torch.randint(0, 10**6, (n,), generator=g, dtype=vdtype) if not vdtype.is_floating_point
              else torch.randn(n, generator=g, dtype=vdtype))
    weights = torch.rand(n, generator=g) if weighted else None
    return lengths, values, weights


def _permutations(T: int, g: torch.Generator) -> List[torch.Tensor]:
    perms = [torch.randperm(T, generator=g), torch.arange(T)]
    if T:  # a subset and a repeat: KJT's permute allows both
        perms.append(torch.randint(0, T, (max(1, T // 2),), generator=g))
        perms.append(torch.randint(0, T, (2 * T,), generator=g))
    return perms


@pytest.mark.parametrize("T,B,max_len", [(1, 1, 3), (4, 8, 5), (7, 3, 0), (5, 0, 4), (0, 4, 2),
                                         (26, 16, 3)])
@pytest.mark.parametrize("ldtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("hint", [False, True])
def test_permute_2d_sparse_data(T: int, B: int, max_len: int, ldtype: torch.dtype,
                                weighted: bool, hint: bool) -> None:
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        for vdtype in (torch.int64, torch.int32, torch.float32):
            lengths, values, weights = _sparse(T, B, max_len, g, ldtype, vdtype, weighted)
            for perm in _permutations(T, g):
                perm = perm.to(torch.int32)
                size = int(lengths[perm.long()].sum()) if hint else None
                got = shim.permute_2D_sparse_data(perm, lengths, values, weights, size)
                want = torch.ops.fbgemm.permute_2D_sparse_data(perm, lengths, values, weights,
                                                              size)
                for a, b in zip(got, want):
                    _same(a, b)


@pytest.mark.parametrize("B", [0, 1, 5, 64])
@pytest.mark.parametrize("dims", [[4], [2, 3], [8, 1, 5, 16], [3, 3, 3, 3, 3, 3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_permute_pooled_embs(B: int, dims: List[int], dtype: torch.dtype) -> None:
    for seed in SEEDS:
        g = torch.Generator().manual_seed(seed)
        offsets = torch.tensor([0, *torch.tensor(dims).cumsum(0).tolist()])
        perm = torch.randperm(len(dims), generator=g)
        inv_perm = torch.argsort(perm)
        inv_offsets = torch.tensor([0, *torch.tensor(dims)[perm].cumsum(0).tolist()])
        pooled = torch.randn(B, sum(dims), generator=g).to(dtype)
        args = (pooled, offsets, perm, inv_offsets, inv_perm)
        _same(shim.permute_pooled_embs(*args), torch.ops.fbgemm.permute_pooled_embs(*args))


def test_permute_pooled_embs_backward_uses_the_inverse() -> None:
    """FBGEMM's autograd op calls the kernel with the inverse lists for the gradient: the
    shim's kernel in that role must undo the permutation."""
    dims = [2, 5, 3]
    offsets = torch.tensor([0, 2, 7, 10])
    perm = torch.tensor([2, 0, 1])
    inv_perm = torch.argsort(perm)
    inv_offsets = torch.tensor([0, 3, 5, 10])
    x = torch.randn(4, sum(dims))
    y = shim.permute_pooled_embs(x, offsets, perm, inv_offsets, inv_perm)
    assert torch.equal(shim.permute_pooled_embs(y, inv_offsets, inv_perm, offsets, perm), x)


def test_install_registers_cuda_only_where_missing() -> None:
    status = shim.install()
    assert set(status) == set(shim.SHIMMED_OPS)
    for op, what in status.items():
        assert what in ("registered", "has a CUDA kernel"), (op, what)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{op}", "CUDA")
    assert shim.install() == status  # idempotent
    # CPU tensors still run FBGEMM's own kernel
    t = torch.tensor([3, 1, 2])
    assert torch.equal(torch.ops.fbgemm.asynchronous_complete_cumsum(t), torch.tensor([0, 3, 4, 6]))


def test_recorder_sees_kjt_ops() -> None:
    """The recorder that found the op list sees the op behind ``KeyedJaggedTensor.offsets``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from robe_torchrec.testing.fbgemm_cuda_shim import FbgemmOpRecorder

    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(5),
                                              torch.tensor([1, 2, 0, 2]))
    with FbgemmOpRecorder() as rec:
        kjt.offsets()
        kjt.permute([1, 0])
    assert "asynchronous_complete_cumsum" in rec.ops
    assert rec.ops <= set(shim.SHIMMED_OPS)
