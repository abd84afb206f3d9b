"""The GPU checks of TorchRec's DLRM (``robe_torchrec/testing/gpu_torchrec_checks.py``) run on
the CPU too, where nothing is captured: their own plumbing (the model, the runs, what they
compare) cannot rot between the rare GPU sessions that run them for real."""

import pytest
import torch

from robe_torchrec.testing.gpu_torchrec_checks import (check_compiled_dlrm,
                                              check_compiled_sequence_lookup,
                                              check_deterministic_dlrm, dlrm_run)


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_the_compiled_dlrm_check_runs_on_the_cpu():
    check_compiled_dlrm(steps=3, device="cpu", require_graphs=False)


def test_the_graphed_run_and_only_it_requires_cuda_graphs(monkeypatch):
    """What ``require_graphs`` does on a GPU: the reduce-overhead run, and only it, runs with
    Inductor's ``triton.cudagraph_or_error``, which fails a graph run without a CUDA graph,
    naming why (Inductor raises so only for graphs on CUDA; on the CPU's it counts the skip,
    so the setting is what can be checked here)."""
    import torch._inductor.config as inductor_config

    from robe_torchrec.testing import gpu_torchrec_checks

    runs = []
    run = gpu_torchrec_checks.dlrm_run

    def recorded(steps, device, compile_kwargs=None):
        runs.append((compile_kwargs, inductor_config.triton.cudagraph_or_error))
        return run(steps, device, compile_kwargs)

    monkeypatch.setattr(gpu_torchrec_checks, "dlrm_run", recorded)
    check_compiled_dlrm(steps=1, device="cpu", require_graphs=True)
    assert runs == [(None, False), ({}, False), ({"mode": "reduce-overhead"}, True)]


def test_the_compiled_sequence_check_runs_on_the_cpu():
    check_compiled_sequence_lookup(steps=2, device="cpu")


def test_the_deterministic_dlrm_check_runs_on_the_cpu():
    check_deterministic_dlrm(steps=3, device="cpu")


def test_a_run_counts_its_steps_in_the_fused_optimizer():
    run = dlrm_run(2, "cpu")
    assert len(run.losses) == 2 and float(run.fused["step"]) == 2
    assert set(run.fused) == {"weight", "sum", "step"}
