"""``python -m benchmarks.gpu_torchrec.app_with_shim [overrides]``: the training app
(``python -m robe_torchrec.train``) with the FBGEMM CUDA shim installed first, for a machine
with a CUDA torch and only fbgemm-gpu-cpu. The app itself is unchanged; its overrides pass
through as given.

With ``ROBE_RECORD_FBGEMM_OPS=<file>`` set, the ``fbgemm::`` ops the app called are written
there as JSON when it exits (how the shim's op list is checked against the app)."""

from __future__ import annotations

import atexit
import json
import os
import runpy

from robe_torchrec.testing import fbgemm_cuda_shim


def main() -> None:
    fbgemm_cuda_shim.install()
    record_to = os.environ.get("ROBE_RECORD_FBGEMM_OPS")
    if not record_to:
        runpy.run_module("robe_torchrec.train", run_name="__main__", alter_sys=True)
        return
    from benchmarks.gpu_torchrec.record_ops import FbgemmOpRecorder

    recorder = FbgemmOpRecorder()

    def dump() -> None:
        with open(record_to, "w") as f:
            json.dump(sorted(recorder.ops), f)

    atexit.register(dump)  # Hydra may end the process with sys.exit
    with recorder:
        runpy.run_module("robe_torchrec.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
