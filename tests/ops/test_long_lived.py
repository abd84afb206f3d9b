"""Tensors the ops keep across calls (``robe_torchrec/ops/long_lived.py``): made outside
inference mode, and on CUDA on a thread of their own, which a CUDA graph pool entered on
the caller's thread does not claim (``long_lived_outside_pools`` in the GPU checks tests
that on a GPU). Here, on the CPU: the thread's plumbing and the CPU path."""

import threading

import pytest
import torch

from robe_torchrec.ops.long_lived import long_lived, on_own_thread


def test_on_own_thread_runs_elsewhere_and_returns_or_raises():
    caller = threading.get_ident()
    assert on_own_thread(threading.get_ident) != caller
    with torch.inference_mode():  # a thread's inference mode is its own
        made = on_own_thread(lambda: torch.zeros(3))
    assert not made.is_inference()

    def fails():
        raise KeyError("made nothing")

    with pytest.raises(KeyError, match="made nothing"):
        on_own_thread(fails)


def test_a_cpu_tensor_is_made_here_and_normal_under_inference_mode():
    caller = threading.get_ident()
    with torch.inference_mode():
        made, where = long_lived(lambda: (torch.ones(2), threading.get_ident()),
                                 torch.device("cpu"))
    assert where == caller and not made.is_inference()
