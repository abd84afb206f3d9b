"""Benchmarks of the ROBE-Z ops and modules.

* :mod:`robe_torchrec.benchmarks.cpu_ops`: one CPU training step of a pair model (the setup
  of the seed benchmarks): full table, FBGEMM's CPU TBE, pure-PyTorch ROBE-Z and the C++ ops.
  Run ``python -m robe_torchrec.benchmarks.cpu_ops --help``.
"""
