"""Feature names in the ops' messages (:mod:`robe_torchrec.ops.feature_names`): at the call,
from a raw op call, and in a deferred check's message, which another call may raise."""

import gc

import pytest
import torch

from robe_torchrec.hashing import HashMode, hash_params
from robe_torchrec.ops import DeferredCheckError, cpu_backend, defer_checks, raise_pending_checks
from robe_torchrec.ops.feature_names import name_features, names_of, with_names
from robe_torchrec.ops.meta import BoundsCheck, Pooling, build_table_meta

MESSAGE = "robe: id 7 at position 3 of feature 1 is out of range [0, 5)"


def test_names_the_feature_once():
    meta = torch.zeros(8, 2, dtype=torch.int64)
    name_features(meta, ["user", "item"])
    named = with_names(MESSAGE, meta)
    assert named == "robe: id 7 at position 3 of feature 1 ('item') is out of range [0, 5)"
    assert with_names(named, meta) == named  # already named: unchanged
    assert with_names(MESSAGE.replace("feature 1", "feature 2"), meta).endswith(
        "of feature 2 is out of range [0, 5)")  # no such column: unchanged
    assert with_names(MESSAGE, torch.zeros(8, 2, dtype=torch.int64)) == MESSAGE  # unnamed


def test_forgets_a_collected_table_meta():
    meta = torch.zeros(8, 2, dtype=torch.int64)
    name_features(meta, ["user", "item"])
    assert names_of(meta) == ("user", "item")
    other = torch.zeros(8, 2, dtype=torch.int64)
    del meta
    gc.collect()
    assert names_of(other) is None


def _layout(num_rows):
    """Two features of dim 4 on one array of 64 floats, as the op takes them."""
    features = len(num_rows)
    meta = build_table_meta([4] * features, [0] * features, [64] * features,
                            [sum(num_rows[:t]) for t in range(features)], num_rows,
                            [int(Pooling.SUM)] * features)
    return meta, (4 * features, 4, int(HashMode.REFERENCE), hash_params(HashMode.REFERENCE, seed=1),
                  int(BoundsCheck.ERROR))


def _lookup(meta, layout, ids):
    weights = torch.randn(64)
    offsets = torch.arange(ids.numel() + 1)
    return torch.ops.robe.forward(weights, ids, offsets, None, meta, *layout)


@pytest.mark.parametrize("backend", ["cpp", "reference", "triton"])
def test_an_op_call_names_the_feature_of_its_table_meta(backend):
    meta, layout = _layout([10, 5])
    name_features(meta, ["user", "item"])
    with cpu_backend(backend), pytest.raises(ValueError, match=r"^robe: id 7 at position 3 "
                                                               r"of feature 1 \('item'\) is out"):
        _lookup(meta, layout, torch.tensor([1, 2, 3, 7]))


def test_a_deferred_problem_is_named_by_its_own_call_not_the_one_that_raises_it():
    """The bad input's table_meta names it, whichever call reads the answer; an input whose
    table_meta has no names keeps its index, not the reading call's names."""
    bad_meta, layout = _layout([10, 5])
    other_meta, _ = _layout([10, 5])
    name_features(bad_meta, ["user", "item"])
    name_features(other_meta, ["query", "ad"])
    unnamed_meta, _ = _layout([10, 5])
    good = torch.tensor([1, 2, 3, 4])
    with cpu_backend("triton"), defer_checks(True):
        for meta, named in ((bad_meta, r"of feature 1 \('item'\) is out"),
                            (unnamed_meta, r"of feature 1 is out")):
            _lookup(meta, layout, torch.tensor([1, 2, 3, 7]))
            with pytest.raises(DeferredCheckError, match=named):
                _lookup(other_meta, layout, good)  # reads the answer (or the next call)
                raise_pending_checks()
