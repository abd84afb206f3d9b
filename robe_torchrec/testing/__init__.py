"""Checks shared by the tests and the benchmarks, shipped with the library so that a GPU
machine, a benchmark or a user's own CI can run them without the repository's tests.

- :mod:`~robe_torchrec.testing.op_cases`: small random op problems (:class:`OpCase`).
- :mod:`~robe_torchrec.testing.op_checks`: the Triton kernels against the reference on
  any device, one check per op and optimizer (:func:`triton_checks`).
- :mod:`~robe_torchrec.testing.gpu_checks`: what only a CUDA device can show: a random
  configuration matrix, no host synchronisation, CUDA graph capture and replay.
- :mod:`~robe_torchrec.testing.gpu_torchrec_checks`: the same for TorchRec's side: its
  DLRM on ROBE-Z tables compiled with CUDA graphs, a compiled sequence lookup, VBE padding.
- :mod:`~robe_torchrec.testing.fbgemm_cuda_shim`: plain-PyTorch CUDA kernels for the few
  FBGEMM sparse ops TorchRec calls, for a GPU machine that only has fbgemm-gpu-cpu, and
  the recorder that lists the ops a piece of code calls.

Nothing here runs on import: each module is imported where it is used.
"""
