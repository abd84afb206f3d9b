"""Each op call runs the static argument checks once: the backward's checks
(``check_backward_inputs``) check ``grad_output`` between the static checks and the layout
ones, and used to run the static ones twice."""

import pytest
import torch

from robe_torchrec.ops import reference, validation
from robe_torchrec.testing.op_cases import random_case


@pytest.fixture
def static_calls(monkeypatch):
    calls = []
    check = validation.check_static

    def counted(*args, **kwargs):
        calls.append(1)
        return check(*args, **kwargs)

    monkeypatch.setattr(validation, "check_static", counted)
    return calls


def test_backward_checks_run_the_static_checks_once(static_calls):
    case = random_case(seed=11)
    grad = torch.randn(int(case.offsets.numel() - 1) // case.table_meta.shape[1], case.output_dim,
                       dtype=torch.float32)
    reference.backward_dense(*case.backward_args(grad))
    assert len(static_calls) == 1


def test_forward_checks_run_the_static_checks_once(static_calls):
    case = random_case(seed=12)
    validation.check_inputs(*case.forward_args())
    assert len(static_calls) == 1


def test_a_bad_block_size_is_still_refused_by_the_backward_checks():
    case = random_case(seed=13)
    grad = torch.randn(int(case.offsets.numel() - 1) // case.table_meta.shape[1], case.output_dim)
    args = list(case.backward_args(grad))
    args[6] = 0  # block_size
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        validation.check_backward_inputs(*args)
