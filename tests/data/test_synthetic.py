"""SyntheticCriteo: deterministic batches whose labels follow the documented hidden model, and
whose sparse features carry signal that the dense ones do not."""

import math

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from robe_torchrec.data.synthetic import NUM_DENSE, SyntheticCriteo


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
