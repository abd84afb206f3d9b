"""Benchmarks, one script per question (``python -m benchmarks.<name> --help``); each writes
its report and the JSON of its numbers with ``--out`` (docs/benchmarks.md reads them):

* ``cpu_ops``: how fast is a CPU training step of the C++ kernel against its peers and floors?
* ``host_overhead``: what does the host spend on one op call, layer by layer?
* ``unpooled_ops``: how fast is the unpooled lookup against its floors?
* ``interaction``: how much faster is ``FastInteractionArch`` than TorchRec's?
* ``train_throughput``: how many samples/s does the app reach (against full tables, on 2
  processes, beside a busy core)?
* ``quality_study``: how much AUC does each compression cost (synthetic data, real rows)?
* ``compress_trained``: what does compressing a trained model cost?
* ``gpu_check`` (with ``gpu_speed``): does the GPU path work, and how fast is it?
* ``gpu_torchrec.run``: does TorchRec's side (DMP, the pipelines, the app) work on a GPU?

``common`` holds what they share: the timing loops and the reports.
"""
