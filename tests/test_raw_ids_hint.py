"""An out-of-range id says how to look up raw ids: ``RobeConfig(bounds_check="unbounded",
hash="mix")`` (issue 31, item 7), in the C++ kernel, the reference (and so the Triton ops,
which share its checks) and the module; and the hint works."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import robe_torchrec.ops  # noqa: F401  (registers torch.ops.robe.*)
from robe_torchrec import RobeConfig, RobeEmbeddingBagCollection
from robe_torchrec.ops import cpu, reference
from robe_torchrec.testing.op_cases import random_case

HINT = 'RobeConfig(bounds_check="unbounded", hash="mix")'


def test_kernel_and_reference_say_how_to_hash_raw_ids():
    case = random_case(51, batch=6, max_bag=4, empty_fraction=0.0)
    case.values[0] = 10**12
    with pytest.raises(ValueError) as ref_err:
        reference.forward(*case.forward_args())
    with pytest.raises(ValueError) as cpp_err:
        cpu.forward(*case.forward_args())
    assert str(cpp_err.value) == str(ref_err.value)
    assert "id 1000000000000 at position 0 of feature 0 is out of range [0, " in str(cpp_err.value)
    assert HINT in str(cpp_err.value), str(cpp_err.value)


def _ebc(**robe) -> RobeEmbeddingBagCollection:
    table = EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1000,
                               feature_names=["user"])
    return RobeEmbeddingBagCollection([table], RobeConfig(compression=10, block_size=4, **robe))


def test_module_error_names_the_fix_and_the_fix_works():
    raw = KeyedJaggedTensor.from_lengths_sync(["user"], torch.tensor([10**12, 3]),
                                              torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"id 1000000000000 .* is out of range \[0, 1000\)") as err:
        _ebc()(raw)
    assert HINT in str(err.value)
    # what the message says to do
    pooled = _ebc(bounds_check="unbounded", hash="mix")(raw).values()
    assert pooled.shape == (2, 8) and bool(torch.isfinite(pooled).all())
