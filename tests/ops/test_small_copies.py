"""Host integers on the device (``robe_torchrec/ops/small_copies.py``)."""

import torch

from robe_torchrec.ops.small_copies import host_ints, ints_on_device


def test_host_ints_stay_on_the_host_whatever_the_default_device():
    """Under ``torch.set_default_device("cuda")`` a plain ``torch.tensor`` would be a CUDA
    tensor, copied from pageable memory and impossible to pin (the meta device stands in)."""
    with torch.device("meta"):
        assert torch.tensor([1]).device.type == "meta"  # what the default device does
        ints = host_ints([3, 1, 2], torch.int32, pinned=False)
    assert ints.device.type == "cpu" and ints.dtype == torch.int32
    assert ints.tolist() == [3, 1, 2]


def test_ints_reach_a_device_that_needs_no_pinning():
    ints = ints_on_device([5, 0, 3], torch.int64, torch.device("cpu"))
    assert ints.tolist() == [5, 0, 3] and ints.dtype == torch.int64
