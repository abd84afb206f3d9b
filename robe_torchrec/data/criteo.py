"""What the real-Criteo loaders share: the column layout, id folding and batch assembly.

The TSV loader (:mod:`robe_torchrec.data.criteo_tsv`) and the npy loader
(:mod:`robe_torchrec.data.criteo_npy`) both end in :func:`make_batch`, so their batches look
exactly like :class:`~robe_torchrec.data.synthetic.SyntheticCriteo`'s: float32 dense
``[B, 13]``, a KeyedJaggedTensor with keys ``cat_0..cat_25`` and one int64 id per sample and
key, float32 labels ``[B]``. A training app can then switch data source by config.

Example::

    >>> import numpy as np
    >>> batch = make_batch(np.zeros((2, 13), np.float32), np.arange(52).reshape(2, 26),
    ...                    np.array([0, 1]), resolve_num_embeddings(10))
    >>> batch.sparse_features["cat_1"].values().tolist()
    [1, 7]
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import numpy as np
import torch
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_DENSE: int = INT_FEATURE_COUNT  # 13
NUM_SPARSE: int = CAT_FEATURE_COUNT  # 26
#: label + 13 integer + 26 categorical columns of a raw Criteo TSV row
NUM_TSV_FIELDS: int = 1 + NUM_DENSE + NUM_SPARSE
#: the sparse keys, the same as SyntheticCriteo's
SPARSE_KEYS: List[str] = list(DEFAULT_CAT_NAMES)

NumEmbeddings = Union[int, Sequence[int], None]


def resolve_num_embeddings(num_embeddings_per_feature: NumEmbeddings) -> Optional[np.ndarray]:
    """Row counts per feature as an int64 array of shape ``[1, 26]`` (``None`` = keep raw ids).

    An int is one hash size for every table; a sequence gives each table its own.
    """
    if num_embeddings_per_feature is None:
        return None
    if isinstance(num_embeddings_per_feature, (int, np.integer)):
        sizes = [int(num_embeddings_per_feature)] * NUM_SPARSE
    else:
        sizes = [int(n) for n in num_embeddings_per_feature]
        if len(sizes) != NUM_SPARSE:
            raise ValueError(
                f"num_embeddings_per_feature has {len(sizes)} entries; Criteo has {NUM_SPARSE} "
                "categorical features (give 26 row counts, or one int for all)"
            )
    if min(sizes) < 1:
        raise ValueError(f"num_embeddings_per_feature must be >= 1 everywhere, got {sizes}")
    return np.asarray(sizes, dtype=np.int64).reshape(1, NUM_SPARSE)


def table_sizes(num_embeddings: Optional[np.ndarray]) -> List[int]:
    """The 26 table row counts, as ``SyntheticCriteo.table_sizes()`` gives them."""
    if num_embeddings is None:
        raise ValueError(
            "num_embeddings_per_feature=None keeps the raw ids, so there are no table sizes; "
            "give 26 row counts or one hash size"
        )
    return num_embeddings.reshape(-1).tolist()


def dlrm_dense_transform(raw: np.ndarray) -> np.ndarray:
    """DLRM's dense normalisation: ``log(1 + max(x, 0))`` as float32.

    Criteo's integer features are heavy-tailed counts (a few are negative, which DLRM clamps).
    """
    return np.log1p(np.maximum(raw, 0).astype(np.float64)).astype(np.float32)


def make_batch(
    dense: np.ndarray,
    sparse: np.ndarray,
    labels: np.ndarray,
    num_embeddings: Optional[np.ndarray],
) -> Batch:
    """One torchrec ``Batch`` from row-major arrays.

    Args:
        dense: ``[B, 13]`` already-normalised dense features (cast to float32).
        sparse: ``[B, 26]`` integer ids, folded here into ``num_embeddings`` rows per feature.
        labels: ``[B]`` or ``[B, 1]`` 0/1 labels (cast to float32, as SyntheticCriteo's).
        num_embeddings: from :func:`resolve_num_embeddings`.
    """
    ids = sparse.astype(np.int64, copy=False)
    if num_embeddings is not None:
        ids = ids % num_embeddings
    b = ids.shape[0]
    # feature-major values: all samples of cat_0, then cat_1, ... (one id per sample and key)
    values = torch.from_numpy(np.ascontiguousarray(ids.T).reshape(-1))
    kjt = KeyedJaggedTensor(
        keys=SPARSE_KEYS,
        values=values,
        lengths=torch.ones(b * NUM_SPARSE, dtype=torch.int32),
    )
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)),
    )
