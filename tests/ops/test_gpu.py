"""The Triton kernels against the reference on CUDA tensors: every check of
:func:`robe_torchrec.testing.op_checks.triton_checks` (collected everywhere, skipped without a GPU).
``python -m benchmarks.gpu_check`` runs the same checks without pytest."""

import pytest
import torch

from robe_torchrec.testing.op_checks import triton_checks
from robe_torchrec.testing.gpu_checks import (compiled_checks, matrix_checks,
                                              sync_and_graph_checks)
from robe_torchrec.testing.gpu_torchrec_checks import torchrec_gpu_checks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# first in the file: before triton_checks' torch_compile check (see sync_and_graph_checks)
SYNC_CHECKS = sync_and_graph_checks()


@pytest.mark.parametrize("check", [c for _, c in SYNC_CHECKS], ids=[n for n, _ in SYNC_CHECKS])
def test_sync_and_graphs(check):
    check()


CHECKS = triton_checks("cuda")


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
def test_triton_matches_reference_on_cuda(check):
    check()


GPU_CHECKS = compiled_checks() + torchrec_gpu_checks() + matrix_checks(40)


@pytest.mark.parametrize("check", [c for _, c in GPU_CHECKS], ids=[n for n, _ in GPU_CHECKS])
def test_gpu_only(check):
    check()
