"""Benchmarks of the ROBE-Z ops and modules.

* :mod:`benchmarks.cpu_ops`: one CPU training step of a pair model (the setup
  of the seed benchmarks): full table, FBGEMM's CPU TBE, pure-PyTorch ROBE-Z and the C++ ops.
  Run ``python -m benchmarks.cpu_ops --help``.
* :mod:`benchmarks.kernel_ab`: the C++ kernels of the working tree against
  another git revision's, side by side in one process (how a kernel change is judged).
* :mod:`benchmarks.hash_choice`: reference against mix hash (AUC and speed).
* :mod:`benchmarks.distributed_step`: a 2-rank DMP step against the unsharded
  model (CPU, gloo).
* :mod:`benchmarks.train_throughput`: the training app with full tables against
  ROBE-Z.
* :mod:`benchmarks.interaction`: TorchRec's DLRM dot interaction against
  :class:`robe_torchrec.interaction.FastInteractionArch`.
* :mod:`benchmarks.quality_study`: AUC against compression, Z and hash.
* :mod:`benchmarks.gpu_check`: the Triton kernels checked and timed on a GPU in one command
  (torch + Triton only; ``--cpu``: the interpreter smoke test CI runs).
* :mod:`benchmarks.busy_machine`: the training app's thread default while another process
  holds a core.

Each writes its numbers with the command and the machine to ``results/`` (``--out``).
"""
