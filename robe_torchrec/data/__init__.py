"""Data sources that yield torchrec ``Batch`` with sparse keys ``cat_0..cat_25``.

``SyntheticCriteo`` generates Criteo-shaped data; ``CriteoTsv`` streams raw Criteo TSV files;
``CriteoNpy`` reads TorchRec's preprocessed npy layout, which ``tsv_to_npy`` writes.
"""

from robe_torchrec.data.criteo import SPARSE_KEYS
from robe_torchrec.data.criteo_npy import CriteoNpy, TsvToNpyResult, check_npy_prefix, npy_paths, tsv_to_npy
from robe_torchrec.data.criteo_tsv import CriteoRowError, CriteoTsv
from robe_torchrec.data.synthetic import CRITEO_KAGGLE_CARDINALITIES, SyntheticCriteo

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "CriteoNpy",
    "CriteoRowError",
    "CriteoTsv",
    "SPARSE_KEYS",
    "SyntheticCriteo",
    "TsvToNpyResult",
    "check_npy_prefix",
    "npy_paths",
    "tsv_to_npy",
]
