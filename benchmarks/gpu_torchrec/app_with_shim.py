"""``python -m benchmarks.gpu_torchrec.app_with_shim [overrides]``: the training app, unchanged,
with the FBGEMM CUDA shim installed first (a CUDA torch with only fbgemm-gpu-cpu). With
``ROBE_RECORD_FBGEMM_OPS=<file>``, the ``fbgemm::`` ops the app called are written there as
JSON at exit (how the shim's op list is checked against the app)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
from pathlib import Path

from robe_torchrec.testing import fbgemm_cuda_shim


def main() -> None:
    from robe_torchrec.testing.fbgemm_cuda_shim import FbgemmOpRecorder

    fbgemm_cuda_shim.install()
    record_to, recorder = os.environ.get("ROBE_RECORD_FBGEMM_OPS"), FbgemmOpRecorder()
    if record_to:  # at exit: Hydra may end the process with sys.exit
        atexit.register(lambda: Path(record_to).write_text(json.dumps(sorted(recorder.ops))))
    with recorder if record_to else contextlib.nullcontext():
        runpy.run_module("robe_torchrec.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
