"""SyntheticCriteo: deterministic batches whose labels follow the documented hidden model, and
whose sparse features carry signal that the dense ones do not."""

import math

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.data.synthetic import (
    FITTED_CARDINALITIES, FITTED_EXPONENTS, NUM_DENSE, SyntheticCriteo)


def test_batches_are_deterministic_and_shaped():
    data = SyntheticCriteo(batch_size=64, cardinality_scale=1e-3, seed=5)
    a, b = data.batch(7), data.batch(7)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
    assert not torch.equal(a.labels, data.batch(8).labels)
    assert a.dense_features.shape == (64, NUM_DENSE)
    assert a.sparse_features.keys() == data.keys and len(data.keys) == 26
    for key, rows in zip(data.keys, data.cardinalities):
        ids = a.sparse_features[key].values()
        assert ids.numel() == 64 and 0 <= int(ids.min()) and int(ids.max()) < rows


def test_labels_follow_the_hidden_logit():
    data = SyntheticCriteo(batch_size=4096, cardinality_scale=1e-2, seed=1)
    batches = [data.batch(i) for i in range(4)]
    labels = torch.cat([b.labels for b in batches])
    p = torch.cat([torch.sigmoid(data.hidden_logit(b)) for b in batches])
    # the click rate matches the model's mean probability to a few standard errors
    assert abs(labels.mean() - p.mean()) < 4 * (p * (1 - p)).mean().sqrt() / labels.numel() ** 0.5
    full = binary_auroc(p, labels.long()).item()
    dense_only = binary_auroc(torch.cat([data.hidden_logit(b, sparse=False) for b in batches]),
                              labels.long()).item()
    # the sparse features carry most of the signal (the quality study reports the numbers)
    assert full > dense_only + 0.1, (full, dense_only)


def test_hidden_logit_is_the_per_feature_sum_and_refuses_other_batches():
    data = SyntheticCriteo(batch_size=64, cardinality_scale=1e-3, seed=3)
    batch = data.batch(5)
    # the hidden model written out feature by feature, in key order
    expected = torch.full((64,), data.bias) + batch.dense_features @ data._dense_weights
    scale = data.sparse_signal / math.sqrt(len(data.keys))
    for f, key in enumerate(data.keys):
        expected += scale * data.id_effects(f, batch.sparse_features[key].values())
    assert torch.equal(data.hidden_logit(batch), expected)
    # a batch with two ids in one bag is not this stream's: refused, not misread
    kjt = batch.sparse_features
    lengths = kjt.lengths().clone()
    lengths[0] = 2
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat([kjt.values(), kjt.values()[:1]]),
                            lengths=lengths)
    with pytest.raises(ValueError, match="one id per bag"):
        data.hidden_logit(Batch(batch.dense_features, bad, batch.labels))
    # as many ids as bags, but two in one bag and none in the next: refused too
    lengths = kjt.lengths().clone()
    lengths[0], lengths[1] = 2, 0
    shifted = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths)
    with pytest.raises(ValueError, match="one id per bag"):
        data.hidden_logit(Batch(batch.dense_features, shifted, batch.labels))


def test_hard_mode_is_the_old_stream_bit_for_bit():
    """Pinned from the stream before the realistic mode existed (old results stay reproducible)."""
    batch = SyntheticCriteo(batch_size=64, cardinality_scale=1e-3, seed=5, mode="hard").batch(7)
    assert int(batch.sparse_features.values().sum()) == 227798
    assert int(batch.labels.sum()) == 49
    assert float(batch.dense_features.sum()) == pytest.approx(16.295394897460938, abs=1e-6)
    assert batch.labels[:16].tolist() == [1.0] * 5 + [0.0] + [1.0] * 6 + [0.0] + [1.0] * 3


def test_realistic_mode_follows_the_fitted_laws():
    data = SyntheticCriteo(batch_size=8192, cardinality_scale=0.01, seed=2, mode="realistic")
    assert data.cardinalities == FITTED_CARDINALITIES
    assert SyntheticCriteo(cardinality_scale=0.02, mode="realistic").cardinalities[2] == \
        2 * FITTED_CARDINALITIES[2]
    batches = [data.batch(i) for i in range(2)]
    labels = torch.cat([b.labels for b in batches])
    # Criteo-like click rate, and labels drawn from sigmoid(hidden logit)
    logits = torch.cat([data.hidden_logit(b) for b in batches])
    p = torch.sigmoid(logits)
    assert abs(labels.mean() - 0.25) < 0.02
    assert abs(labels.mean() - p.mean()) < 4 * (p * (1 - p)).mean().sqrt() / labels.numel() ** 0.5
    full = binary_auroc(logits, labels.long()).item()
    dense_only = binary_auroc(torch.cat([data.hidden_logit(b, sparse=False) for b in batches]),
                              labels.long()).item()
    assert full > dense_only + 0.08, (full, dense_only)
    # each feature's most popular id takes its power law's share of the rows (within 5 sigma)
    for f, key in enumerate(data.keys):
        ids = torch.cat([b.sparse_features[key].values() for b in batches])
        ranks = torch.arange(1, data.cardinalities[f] + 1, dtype=torch.float64)
        p_top = float(1 / ranks.pow(-FITTED_EXPONENTS[f]).sum())
        sigma = (p_top * (1 - p_top) / ids.numel()) ** 0.5
        assert abs(float((ids == 0).double().mean()) - p_top) < 5 * sigma + 1e-9, key
        assert 0 <= int(ids.min()) and int(ids.max()) < data.cardinalities[f]


def test_realistic_id_parameters_shrink_with_rarity_and_bad_modes_are_refused():
    data = SyntheticCriteo(batch_size=16, cardinality_scale=0.01, seed=0, mode="realistic")
    # one feature, popular ids (0..999) against rare ones (50000..50999): the rare ids'
    # sparse logit varies less (their effects and factors shrink by rank ** -0.25)
    one = SyntheticCriteo(cardinality_scale=0.01, seed=0, mode="realistic", num_sparse=3)
    popular = one._realistic_sparse_logit(torch.arange(3000).view(3, 1000))
    rare = one._realistic_sparse_logit(torch.arange(50_000, 53_000).view(3, 1000))
    assert rare.std() < 0.5 * popular.std()
    assert data.batch(3).labels.shape == (16,)
    with pytest.raises(ValueError, match="mode='soft'"):
        SyntheticCriteo(mode="soft")
    with pytest.raises(ValueError, match="click_rate"):
        SyntheticCriteo(mode="realistic", click_rate=1.5)
