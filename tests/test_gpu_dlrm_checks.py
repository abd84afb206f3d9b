"""The GPU checks of TorchRec's DLRM (``robe_torchrec/testing/gpu_checks.py``) run on the CPU
too, where nothing is captured: their own plumbing (the model, the runs, what they compare)
cannot rot between the rare GPU sessions that run them for real."""

import pytest
import torch

from robe_torchrec.testing.gpu_checks import (check_compiled_dlrm,
                                              check_compiled_sequence_lookup,
                                              check_deterministic_dlrm, dlrm_run)


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_the_compiled_dlrm_check_runs_on_the_cpu():
    check_compiled_dlrm(steps=3, device="cpu", require_graphs=False)


def test_a_graph_left_out_of_cuda_graphs_fails_the_check():
    """What ``require_graphs`` does on a GPU: the CPU's graphs are all left out, by name."""
    with pytest.raises(Exception, match="skipping cudagraphs due to cpu device"):
        check_compiled_dlrm(steps=1, device="cpu", require_graphs=True)


def test_the_compiled_sequence_check_runs_on_the_cpu():
    check_compiled_sequence_lookup(steps=2, device="cpu")


def test_the_deterministic_dlrm_check_runs_on_the_cpu():
    check_deterministic_dlrm(steps=3, device="cpu")


def test_a_run_counts_its_steps_in_the_fused_optimizer():
    run = dlrm_run(2, "cpu")
    assert len(run.losses) == 2 and float(run.fused["step"]) == 2
    assert set(run.fused) == {"weight", "sum", "step"}
