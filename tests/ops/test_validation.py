"""The checks' memory of ``table_meta``: checked once per tensor and version, never trusted
after an in-place change, and forgotten with the tensor; and the fused step's optimizer
arguments, checked at every step."""

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


def test_a_host_table_meta_goes_to_the_kernels_device_once_per_version():
    """The Triton ops take a CPU table_meta with device weights: one copy per version (none
    per call), and an inference tensor, which has no version, copied at each call instead of
    failing (``meta`` stands in for CUDA here)."""
    from robe_torchrec.ops import triton_kernels as tk

    on = torch.device("meta")
    meta = m.build_table_meta([8, 4], [0, 0], [100, 100], [0, 10], [10, 10], [0, 0])
    first = tk._meta_on(meta, on)
    assert first.device == on and tk._meta_on(meta, on) is first
    meta[m.DIM, 1] = 5  # in place: a new copy
    assert tk._meta_on(meta, on) is not first
    with torch.inference_mode():
        served = m.build_table_meta([8], [0], [100], [0], [10], [0])
        assert tk._meta_on(served, on).shape == served.shape


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


_HPARAMS = [0.01, 1e-8, 0.9, 0.999, 0.0]


def _states(weights, optimizer, block_size):
    """The state tensors ``optimizer`` reads, as its fused step wants them."""
    full, empty = torch.zeros_like(weights), weights.new_empty(0)
    rows = torch.zeros(m.rowwise_state_size(weights.numel(), block_size))
    return {m.Optimizer.SGD: (empty, empty), m.Optimizer.ADAGRAD: (full, empty),
            m.Optimizer.ADAM: (full, torch.zeros_like(weights)),
            m.Optimizer.ROWWISE_ADAGRAD: (rows, empty)}[optimizer]


@pytest.mark.parametrize("optimizer", list(m.Optimizer))
def test_optimizer_args_take_each_optimizers_own_state(optimizer):
    """Each fused optimizer's state is accepted as its step wants it, and a state of another
    length is refused, naming the state that is wrong."""
    weights, block_size = torch.zeros(250), 8
    state1, state2 = _states(weights, optimizer, block_size)
    validation.check_optimizer_args(weights, state1, state2, int(optimizer), _HPARAMS, 1,
                                    block_size)
    wrong = torch.zeros(7)
    if optimizer != m.Optimizer.SGD:
        with pytest.raises(ValueError, match="state1 must be a contiguous"):
            validation.check_optimizer_args(weights, wrong, state2, int(optimizer), _HPARAMS, 1,
                                            block_size)
    if optimizer == m.Optimizer.ADAM:
        with pytest.raises(ValueError, match="state2 must be a contiguous"):
            validation.check_optimizer_args(weights, state1, wrong, int(optimizer), _HPARAMS, 1,
                                            block_size)
        with pytest.raises(ValueError, match="Adam's step counts from 1"):
            validation.check_optimizer_args(weights, state1, state2, int(optimizer), _HPARAMS,
                                            0, block_size)
    with pytest.raises(ValueError, match="hparams must hold 5 floats"):
        validation.check_optimizer_args(weights, state1, state2, int(optimizer), _HPARAMS[:4],
                                        1, block_size)


def test_an_unknown_optimizer_number_is_refused():
    weights = torch.zeros(16)
    with pytest.raises(ValueError, match="unknown fused optimizer 7"):
        validation.check_optimizer_args(weights, weights, weights, 7, _HPARAMS, 1, 4)


def test_the_meta_device_mixed_with_data_is_refused():
    """A tensor on the meta device sends a call to the shape-only kernel; with the other
    arguments holding data it would return memory as it was left, checked by nothing."""
    from robe_torchrec.hashing import HashMode, hash_params
    from robe_torchrec.ops.meta import BoundsCheck, Pooling, build_table_meta

    meta = build_table_meta([4], [0], [64], [0], [10], [int(Pooling.SUM)])
    layout = (4, 4, int(HashMode.REFERENCE), hash_params(HashMode.REFERENCE, seed=1),
              int(BoundsCheck.ERROR))
    weights, ids = torch.zeros(64), torch.tensor([1, 2, 3])
    offsets = torch.arange(4)
    with pytest.raises(ValueError, match="mix the meta device with tensors holding data"):
        torch.ops.robe.forward(weights, ids, offsets, None, meta.to("meta"), *layout)
    with pytest.raises(ValueError, match="mix the meta device with tensors holding data"):
        torch.ops.robe.unpooled_keys(ids, [3], meta.to("meta"), *layout)
    # all on the meta device: shapes, as before
    out = torch.ops.robe.forward(weights.to("meta"), ids.to("meta"), offsets.to("meta"), None,
                                 meta.to("meta"), *layout)
    assert out.is_meta and out.shape == (3, 4)


def test_a_table_meta_first_seen_inside_a_capture_is_refused_by_name(monkeypatch):
    """Checking a new table_meta copies it to the host, which a CUDA graph capture refuses
    with CUDA's own error (and an invalidated capture): the op says what to do instead. A
    CUDA tensor and a capture stand in."""
    import types

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    meta = types.SimpleNamespace(_version=0, is_cuda=True)
    with pytest.raises(RuntimeError, match="first seen inside a CUDA graph capture.*module "
                                           "buffer"):
        validation.checked_table_meta(meta, 8, 4, 64)
