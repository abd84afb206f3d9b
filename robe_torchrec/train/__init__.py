"""Hydra training app: TorchRec's DLRM / DLRM_DCN with ROBE-Z (or full) embeddings.

Run::

    python -m robe_torchrec.train                                   # 1 process, CPU, synthetic data
    python -m robe_torchrec.train embedding=full model=dcn run.steps=500
    python -m robe_torchrec.train -m embedding.compression=100,1000  # a sweep
    torchrun --nproc-per-node 2 -m robe_torchrec.train run.checkpoint_every=50
    torchx run -s local_cwd robe_torchrec/components.py:train -j 1x2 -- run.steps=100

Modules, one job each: ``app`` (process group + Hydra entry), ``config`` (checks),
``model`` (the config as a ``robe_torchrec.dlrm.DLRMSpec``; planner, DMP, optimizers),
``data`` (batch sources), ``pipeline`` (train-pipeline factory), ``trainer`` (``train``, the
recipe, and ``Trainer``, its steps: build, resume, segments, validation, checkpoints, test),
``checkpoint`` (torch.distributed.checkpoint), ``metrics`` (AUC, log loss, CSV).
"""
