"""Each op call runs the static argument checks once: the backward's checks
(``check_backward_inputs``) check ``grad_output`` between the static checks and the layout
ones, and used to run the static ones twice."""

import dataclasses
import doctest

import pytest
import torch

from robe_torchrec.ops import meta as m
from robe_torchrec.ops import reference, tiles, validation
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


@pytest.mark.parametrize("impl", ["reference", "triton", "cpp"])
@pytest.mark.parametrize("optimizer", [m.Optimizer.SGD, m.Optimizer.ROWWISE_ADAGRAD])
def test_the_fused_backward_refuses_a_bad_block_size_before_any_write(impl, optimizer):
    """The optimizer-argument checks leave ``block_size`` to the layout checks, which every
    implementation runs first: a bad one is still refused, with nothing written."""
    from robe_torchrec.ops import cpu_backend, triton_kernels

    if impl == "triton" and not triton_kernels.interpreted():
        pytest.skip("triton is imported without its interpreter in this process")
    case = random_case(seed=14)
    weights, state = case.weights.clone(), torch.zeros(4)
    before = weights.clone()
    backend = {"reference": reference, "triton": triton_kernels, "cpp": torch.ops.robe}[impl]
    with pytest.raises((ValueError, RuntimeError), match="block_size must be >= 1"), \
            cpu_backend("cpp" if impl == "cpp" else "reference"):
        backend.backward_fused_(case.grad(), weights, state, state, case.values, case.offsets,
                                case.per_sample_weights, case.table_meta, 0, case.hash_mode,
                                case.hash_params, int(optimizer), [0.1, 1e-8, 0.9, 0.99, 0.0], 1)
    assert torch.equal(weights, before)


@pytest.fixture
def layout_calls(monkeypatch):
    """How often the Triton wrappers check a forward's and a backward's static layout."""
    from robe_torchrec.ops import triton_kernels

    calls = []
    for name in ("check_layout", "check_backward_layout"):
        check = getattr(triton_kernels, name)

        def counted(*args, _check=check, _name=name, **kwargs):
            calls.append(_name)
            return _check(*args, **kwargs)

        monkeypatch.setattr(triton_kernels, name, counted)
    return calls


def test_the_triton_wrappers_check_a_layout_once(layout_calls):
    """A module calls with the same layout every step: the Triton wrappers check it at the
    first call and remember it, until ``table_meta`` changes in place or a shape does; a
    change that breaks the layout is still refused. Launches stubbed: nothing runs."""
    from robe_torchrec.ops import defer_checks, triton_kernels

    case = random_case(seed=15)
    grad = case.grad()
    with triton_kernels.stubbed_launches(), defer_checks(False):
        for _ in range(3):
            triton_kernels.forward(*case.forward_args())
            triton_kernels.backward_dense(*case.backward_args(grad))
            triton_kernels.per_sample_weights_grad(*case.psw_grad_args(grad))
        assert layout_calls == ["check_layout", "check_backward_layout"]
        case.table_meta[m.POOLING, 0] = 1 - case.table_meta[m.POOLING, 0]  # in place
        triton_kernels.forward(*case.forward_args())
        triton_kernels.backward_dense(*case.backward_args(grad))
        assert layout_calls[2:] == ["check_layout", "check_backward_layout"]
        wider = torch.cat([grad, grad[:, :1]], dim=1)  # an output with a column to spare
        triton_kernels.backward_dense(*case.backward_args(wider))
        assert layout_calls[4:] == ["check_backward_layout"]
        case.table_meta[m.DIM, 0] += 10**6  # past the output: refused at once
        with pytest.raises(ValueError):
            triton_kernels.backward_dense(*case.backward_args(grad))


def _with_batch(case, other):
    """``case`` with the ids (offsets, per-sample weights) of ``other``: a later batch of the
    same tables."""
    return dataclasses.replace(case, values=other.values, offsets=other.offsets,
                               per_sample_weights=other.per_sample_weights)


def test_batches_with_more_or_fewer_ids_share_a_layout_check(layout_calls):
    """Bags of several ids hold a different number in all every batch. The wrappers check a
    layout once for all such batches while their bags tile alike (the mean bag on the same
    side of the tuning's thresholds, the same power of two above it), and again for a batch
    whose bags tile otherwise; each batch's output and gradient are its own. Per-sample
    weights that do not match the ids are refused whatever plan exists."""
    from robe_torchrec.ops import defer_checks, triton_kernels

    if not triton_kernels.interpreted():
        pytest.skip("triton is imported without its interpreter in this process")
    rows = [300, 4000, 50, 900]
    first = random_case(seed=21, weighted=True, batch=16, max_bag=4, num_rows=rows)
    batches = [first] + [_with_batch(first, random_case(seed=s, weighted=True, batch=16,
                                                          max_bag=4, num_rows=rows))
                         for s in (22, 23)]
    assert len({b.values.numel() for b in batches}) == 3
    tuning = triton_kernels.current_tuning()
    lengths = {tiles.bag_lengths(b.values.numel(), b.offsets.numel() - 1, tuning)
               for b in batches}
    assert len(lengths) == 1  # the premise: the three batches tile alike
    grad = first.grad()
    with defer_checks(False):
        for batch in batches:
            torch.testing.assert_close(triton_kernels.forward(*batch.forward_args()),
                                       reference.forward(*batch.forward_args()))
            torch.testing.assert_close(triton_kernels.backward_dense(*batch.backward_args(grad)),
                                       reference.backward_dense(*batch.backward_args(grad)))
        assert layout_calls == ["check_layout", "check_backward_layout"]
        layout_calls.clear()
        long_bags = _with_batch(first, random_case(seed=24, weighted=True, batch=16,
                                                   max_bag=64, fixed_bags=True,
                                                   empty_fraction=0.0, num_rows=rows))
        torch.testing.assert_close(triton_kernels.forward(*long_bags.forward_args()),
                                   reference.forward(*long_bags.forward_args()))
        assert layout_calls == ["check_layout"]
        short_psw = dataclasses.replace(batches[1],
                                        per_sample_weights=batches[2].per_sample_weights)
        with pytest.raises(ValueError, match="per_sample_weights has"):
            triton_kernels.forward(*short_psw.forward_args())


def test_the_bag_lengths_power_of_two_is_the_tiles_one():
    """``bag_lengths`` computes the power of two above the mean bag inline (it runs before
    every plan lookup); it must stay the ``next_pow2`` of the rounded-up mean that the
    tiles were sized by, for empty batches and empty bags too."""
    from robe_torchrec.ops import triton_kernels

    tuning = triton_kernels.current_tuning()
    for num_bags in range(0, 40):
        for num_values in range(0, 300):
            mean_up = -(-num_values // max(num_bags, 1))
            assert tiles.bag_lengths(num_values, num_bags, tuning)[2] == \
                tiles.next_pow2(max(mean_up, 1)), (num_values, num_bags)


def test_batches_of_other_sizes_share_a_layout_check(layout_calls):
    """An unpooled lookup or a padded variable batch has another number of bags every
    batch. The wrappers check a layout once for batches of every size (with bags that tile
    alike); each batch gets its own output, gradient and grid. What depends on the size is
    still checked for each: offsets that are not ``T * B + 1``, a ``grad_output`` of
    another ``B``. A batch without bags has a layout of its own (nothing launched; its
    offsets still checked)."""
    from robe_torchrec.ops import defer_checks, triton_kernels

    if not triton_kernels.interpreted():
        pytest.skip("triton is imported without its interpreter in this process")
    rows = [300, 4000, 50, 900]
    first = random_case(seed=31, weighted=True, batch=5, max_bag=2, num_rows=rows)
    batches = [first] + [_with_batch(first, random_case(seed=s, weighted=True, batch=b,
                                                          max_bag=2, num_rows=rows))
                         for s, b in ((32, 1), (33, 12), (34, 3))]
    tuning = triton_kernels.current_tuning()
    lengths = {tiles.bag_lengths(b.values.numel(), b.offsets.numel() - 1, tuning)
               for b in batches}
    assert len(lengths) == 1  # the premise: the batches tile alike
    with defer_checks(False):
        for batch in batches:
            grad = batch.grad(seed=batch.batch)
            torch.testing.assert_close(triton_kernels.forward(*batch.forward_args()),
                                       reference.forward(*batch.forward_args()))
            torch.testing.assert_close(triton_kernels.backward_dense(*batch.backward_args(grad)),
                                       reference.backward_dense(*batch.backward_args(grad)))
            torch.testing.assert_close(
                triton_kernels.per_sample_weights_grad(*batch.psw_grad_args(grad)),
                reference.per_sample_weights_grad(*batch.psw_grad_args(grad)))
        # the per-sample weights' gradient: a backward layout without them
        checked = ["check_layout", "check_backward_layout", "check_backward_layout"]
        assert layout_calls == checked

        one_short = dataclasses.replace(first, offsets=first.offsets[:-1])
        with pytest.raises(ValueError, match="expected T \\* B \\+ 1"):
            triton_kernels.forward(*one_short.forward_args())
        with pytest.raises(ValueError, match="expected T \\* B \\+ 1"):
            triton_kernels.backward_dense(*one_short.backward_args(first.grad()))
        other_rows = batches[1].grad()
        with pytest.raises(ValueError, match="grad_output must be \\[B=5"):
            triton_kernels.backward_dense(*first.backward_args(other_rows))
        assert layout_calls == checked

        empty = dataclasses.replace(first, values=first.values[:0],
                                    offsets=first.offsets[:1].clone(),
                                    per_sample_weights=first.per_sample_weights[:0])
        assert triton_kernels.forward(*empty.forward_args()).shape == (0, first.output_dim)
        bad_empty = dataclasses.replace(empty, offsets=empty.offsets + 3)
        with pytest.raises(ValueError, match="offsets"):
            triton_kernels.forward(*bad_empty.forward_args())
        assert layout_calls[3:] == ["check_layout"]  # one for both empty batches


def test_a_batch_too_large_for_its_output_is_refused_by_a_cached_plan(layout_calls):
    """The output-size check runs for every batch size: a layout checked with a smaller
    batch does not vouch for a larger one."""
    from robe_torchrec.ops import defer_checks, triton_kernels

    one_id = dict(max_bag=1, fixed_bags=True, empty_fraction=0.0, num_rows=[40] * 4)
    case = random_case(seed=35, batch=1, **one_id)
    args = list(case.forward_args())
    args[5] = 2**59  # columns to spare read 0; the bytes of 2 samples overflow int64
    two = random_case(seed=36, batch=2, **one_id)
    with triton_kernels.stubbed_launches(), defer_checks(False):
        with pytest.raises(RuntimeError):  # one sample fits the check, not the memory
            triton_kernels.forward(*args)
        args[1], args[2] = two.values, two.offsets
        with pytest.raises(ValueError, match="too large to allocate"):
            triton_kernels.forward(*args)
        assert layout_calls == ["check_layout"]  # the plan of the first call


def test_the_tiles_docstring_example_runs():
    result = doctest.testmod(tiles)
    assert result.attempted > 0 and result.failed == 0
