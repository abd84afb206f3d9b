"""The Hydra configs of the training app (``config.yaml`` and its group folders) and of
``robe_torchrec.pipelines.compare`` (``pipeline_compare/``). Installed as the package
``robe_torchrec_configs`` (see pyproject.toml); found by ``robe_torchrec.hydra_configs``."""
