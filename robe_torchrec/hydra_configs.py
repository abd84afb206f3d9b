"""Where the Hydra configs are: the repository's top-level ``configs/`` folder, which a wheel
carries as the package ``robe_torchrec_configs`` (pyproject.toml maps one to the other).

Used by the training app (``robe_torchrec.train``) and the pipeline comparison
(``robe_torchrec.pipelines.compare``), so both run from a checkout, an editable install or a wheel.
The app's files are typed: each names its schema, which ``robe_torchrec.train.schema.register()``
puts in Hydra's ConfigStore; compose them after calling it.

Example::

    >>> config_dir()                      # .../configs, or .../robe_torchrec_configs
    >>> config_dir("pipeline_compare")    # the comparison's primary config folder
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: the package a wheel installs ``configs/`` as
CONFIG_PACKAGE = "robe_torchrec_configs"
#: a configs folder to use instead of the shipped one
CONFIG_ENV = "ROBE_TRAIN_CONFIGS"


def _shipped() -> Path:
    # an installed wheel (or an editable install made since the mapping exists) ...
    spec = importlib.util.find_spec(CONFIG_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    # ... else a checkout: configs/ beside the robe_torchrec package
    return Path(__file__).resolve().parents[1] / "configs"


def config_dir(group: str = "") -> Path:
    """The configs folder (``$ROBE_TRAIN_CONFIGS`` if set), or its sub-folder ``group``.
    Raises FileNotFoundError if it holds no ``config.yaml``."""
    env = os.environ.get(CONFIG_ENV)
    path = (Path(env) if env else _shipped()) / group
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in {path}: install robe_torchrec (wheel or "
                                f"editable) or set {CONFIG_ENV} to the configs/ folder")
    return path
