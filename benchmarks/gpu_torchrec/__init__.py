"""The GPU proof of the pipelines, DMP and the training app on a machine that has a CUDA
torch but no CUDA FBGEMM: carried wheels (``wheels.sh``), a CUDA shim of the few FBGEMM sparse
ops TorchRec calls (``fbgemm_cuda_shim``), and the one command that runs it all (``run``)."""
