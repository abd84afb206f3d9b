#!/usr/bin/env bash
# Every GPU command of the project in one call, for a GPU machine reached by copying the
# working tree (with the carried wheels in .whl/, see benchmarks/gpu_torchrec/wheels.sh):
# the kernel checks and speed (benchmarks.gpu_check), the host's time per op call
# (benchmarks.host_overhead --cuda), TorchRec's side on the GPU
# (benchmarks.gpu_torchrec.run) and an Nsight Compute profile of the lookups, each with a
# time limit so that one slow part cannot eat the others'. About 5 minutes on an H100.
#
#   bash benchmarks/gpu_session.sh OUT_DIR CARD COMMIT   # $OUT h100 "$(git rev-parse --short HEAD)"
#
# Writes OUT_DIR/gpu_check_CARD.md, OUT_DIR/host_overhead_CARD.md, OUT_DIR/ncu_CARD.csv,
# OUT_DIR/pipelines_CARD.tgz (the pipelines report, its .json, trace, compare report and the
# unpooled lookup's report) and a log of each part. Exit status: the number of parts that
# failed.
set -u
out=${1:?OUT_DIR}; card=${2:?CARD}; commit=${3:?COMMIT}
mkdir -p "$out" /tmp/robe_pipelines
export PYTHONUNBUFFERED=1
# cuBLAS is deterministic only with a fixed workspace (the deterministic DLRM check)
export CUBLAS_WORKSPACE_CONFIG=:4096:8
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$out/pip.log" 2>&1 || echo "wheels did not install: see pip.log"
fi
# An uninstalled copy: the folder pipelines/ is imported as robe_torchrec.pipelines, which an
# install maps (pyproject's package-dir) and a link does here.
[ -e robe_torchrec/pipelines ] || ln -s ../pipelines robe_torchrec/pipelines
export PYTHONPATH=/tmp/site:.
failed=0
# the checks stop starting after 140 s, so the speed section keeps the rest of the 225
timeout 225 python3 -m benchmarks.gpu_check --matrix 24 --checks-budget 140 --reps 10 --inner 3 \
  --out "$out/gpu_check_$card.md" >"$out/gpu_check.log" 2>&1 || failed=$((failed + 1))
# its launched rows compile the backward and optimizer kernels first
timeout 90 python3 -m benchmarks.host_overhead --cuda --reps 20 \
  --out "$out/host_overhead_$card.md" >"$out/host_overhead.log" 2>&1 || failed=$((failed + 1))
timeout 200 python3 -m benchmarks.gpu_torchrec.run --commit "$commit" \
  --out "/tmp/robe_pipelines/gpu_pipelines_$card.md" >/tmp/robe_pipelines/log.txt 2>&1 \
  || failed=$((failed + 1))
rm -rf /tmp/robe_pipelines/*_app
tar czf "$out/pipelines_$card.tgz" -C /tmp/robe_pipelines .
if command -v ncu >/dev/null; then
  timeout 75 ncu --csv --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats \
    --section Occupancy --section LaunchStats --launch-count 30 \
    -k regex:"forward|backward|hash_starts|gather|optimizer" \
    python3 -m benchmarks.gpu_check --profile-launches \
    >"$out/ncu_$card.csv" 2>"$out/ncu.log" || failed=$((failed + 1))
fi
echo "$failed part(s) failed"
exit "$failed"
