"""Table sizes of public click-log datasets, importable without torchrec (the GPU
benchmark ``benchmarks/gpu_check.py`` runs where torchrec is not installed).

Example::

    >>> from robe_torchrec.cardinalities import CRITEO_KAGGLE_CARDINALITIES
    >>> len(CRITEO_KAGGLE_CARDINALITIES), sum(CRITEO_KAGGLE_CARDINALITIES)
    (26, 33762577)
"""

from typing import List

#: Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features
CRITEO_KAGGLE_CARDINALITIES: List[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
