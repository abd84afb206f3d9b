"""A wheel built from the repository carries the Hydra configs and runs the app: built with
``pip wheel``, installed with ``pip install --target``, run from a folder outside the repo.
pyproject.toml lists its packages (see the comment there): the list must match the tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package_and_config_group():
    tool = _setuptools()
    code = set(find_packages(str(ROOT), include=["robe_torchrec*"]))
    code |= {"robe_torchrec.pipelines"}
    groups = {f"robe_torchrec_configs.{p.name}" for p in (ROOT / "configs").iterdir()
              if p.is_dir() and any(p.glob("*.yaml"))}
    listed = set(tool["packages"])
    assert code | groups | {"robe_torchrec_configs"} <= listed, "add them to pyproject.toml"
    assert tool["package-dir"] == {"robe_torchrec.pipelines": "pipelines",
                                   "robe_torchrec_configs": "configs"}
    assert "pipelines" not in listed, "nothing installs under the generic name pipelines"
    assert all(tool["package-data"].get(g) == ["*.yaml"] for g in groups)


@pytest.mark.slow
def test_wheel_install_trains_outside_the_repo(tmp_path):
    src, dist = tmp_path / "src", tmp_path / "dist"
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    # from a copy: setuptools builds in <project>/build, whose leftovers would go into the
    # next wheel built there
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "outputs", "multirun", "*.egg-info", "__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w",
                    str(dist)], cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("robe_torchrec-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "ROBE_TRAIN_CONFIGS", "ROBE_RUN_STAMP")}
    env["PYTHONPATH"] = str(site)

    def python(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)

    where = python("-c", "import robe_torchrec, robe_torchrec.pipelines as p; "
                         "from robe_torchrec.hydra_configs import config_dir; "
                         "print(robe_torchrec.__file__, p.__file__, config_dir())")
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(Path(p).is_relative_to(site) for p in where.stdout.split()), where.stdout

    out = python("-m", "robe_torchrec.train", "run.steps=4", "run.batch_size=64",
                 "run.log_every=2", "run.eval_batches=1", "run.test_batches=1",
                 "run.progress_bar=false", "data.cardinality_scale=0.001")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (metrics,) = (work / "outputs").rglob("metrics.csv")
    phases = [line.split(",")[0] for line in metrics.read_text().splitlines()[1:]]
    assert phases == ["train", "train", "val", "test"], phases
