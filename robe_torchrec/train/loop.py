"""The former home of :func:`train`, now :mod:`robe_torchrec.train.trainer`; kept while
``benchmarks/quality_study.py`` imports it from here."""

from robe_torchrec.train.trainer import train

__all__ = ["train"]
