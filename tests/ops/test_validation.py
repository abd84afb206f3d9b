"""The checks' memory of ``table_meta``: checked once per tensor and version, never trusted
after an in-place change, and forgotten with the tensor."""

import gc
import weakref

import pytest
import torch

from robe_torchrec.ops import meta as m
from robe_torchrec.ops import reference, validation

from robe_torchrec.testing.op_cases import random_case


def test_an_in_place_change_to_table_meta_is_checked_again():
    case = random_case(seed=5)
    args = case.forward_args()
    reference.forward(*args)  # checked and remembered
    case.table_meta[m.DIM, 0] = -1  # in place: a new version
    with pytest.raises(ValueError, match="negative entry"):
        reference.forward(*args)


def test_other_arguments_are_checked_again():
    case = random_case(seed=6)
    weights, values, offsets, psw, meta, output_dim, *rest = case.forward_args()
    reference.forward(weights, values, offsets, psw, meta, output_dim, *rest)
    with pytest.raises(ValueError, match="smaller than the features' dims"):
        reference.forward(weights, values, offsets, psw, meta, output_dim - 1, *rest)
    with pytest.raises(ValueError, match="lie inside weights"):
        reference.forward(weights[:3], values, offsets, psw, meta, output_dim, *rest)


def test_a_remembered_table_meta_is_forgotten_with_its_tensor():
    """The memory holds no strong reference to the tensor (a CPU table_meta is its own CPU
    copy, so it keeps a clone): the tensor dies with its last user, and its entry with it."""
    case = random_case(seed=7)
    meta = case.table_meta
    reference.forward(*case.forward_args())
    assert meta in validation._CHECKED_META
    alive = weakref.ref(meta)
    del case, meta
    gc.collect()
    assert alive() is None


def test_inference_tensors_are_checked_every_call():
    case = random_case(seed=8)
    with torch.inference_mode():
        meta = case.table_meta.clone()  # an inference tensor: no version counter
        weights, values, offsets, psw, _, *rest = case.forward_args()
        reference.forward(weights, values, offsets, psw, meta, *rest)
        meta[m.POOLING, 0] = 7
        with pytest.raises(ValueError, match="POOLING"):
            reference.forward(weights, values, offsets, psw, meta, *rest)


def test_meta_facts_follow_the_tensor_version_and_arguments():
    """The facts derived from a checked table_meta (widest and narrowest dim, blocks, hash
    span, whether the columns cover the output) are remembered, and recomputed after an in-place change or
    for other arguments."""
    meta = m.build_table_meta([8, 4], [0, 0], [100, 100], [0, 10], [10, 10], [0, 0])
    facts = validation.meta_facts(meta, 3, 12)
    assert facts == validation.MetaFacts(max_dim=8, max_blocks=3, max_span=98,
                                         covers_output=True, max_key_end=20, min_dim=4,
                                         any_mean=False)
    assert validation.meta_facts(meta, 3, 12) is facts  # remembered
    meta[m.DIM, 1] = 9  # in place: features now overlap
    assert validation.meta_facts(meta, 3, 12) == validation.MetaFacts(9, 3, 98, False, 20, 8,
                                                                      False)
    assert not validation.meta_facts(meta, 3, 13).covers_output
    meta[m.OUT_OFFSET, 1] = 8
    meta[m.POOLING, 0] = int(m.Pooling.MEAN)
    assert validation.meta_facts(meta, 4, 17) == validation.MetaFacts(9, 3, 97, True, 20, 8,
                                                                      True)
