#!/usr/bin/env bash
# Every GPU command of the project in one call, for a GPU machine reached by copying the
# working tree (with the carried wheels in .whl/, see benchmarks/gpu_torchrec/wheels.sh):
# the kernels' speed and checks (benchmarks.gpu_check), the host's time per op call
# (benchmarks.host_overhead --cuda), TorchRec's side on the GPU
# (benchmarks.gpu_torchrec.run) and an Nsight Compute profile of the lookups, each with a
# time limit so that one slow part cannot eat the others'. At most 8 minutes in all, so
# that a part can be run again on the same machine within a session's 15.
#
#   bash benchmarks/gpu_session.sh OUT_DIR CARD COMMIT   # $OUT h100 "$(git rev-parse --short HEAD)"
#
# Writes to OUT_DIR six files at most (the device tool brings back eight):
# gpu_speed_CARD.md, gpu_check_CARD.md, host_overhead_CARD.md, ncu_CARD.csv,
# pipelines_CARD.tgz (the pipelines report, its .json, trace, compare report and the
# unpooled lookup's report) and logs_CARD.tgz (every part's log and the reports' .json),
# the last packed again after each part. Exit status: the number of parts that failed.
set -u
out=${1:?OUT_DIR}; card=${2:?CARD}; commit=${3:?COMMIT}
logs=/tmp/robe_session
mkdir -p "$out" "$logs" /tmp/robe_pipelines
export PYTHONUNBUFFERED=1
# cuBLAS is deterministic only with a fixed workspace (the deterministic DLRM check)
export CUBLAS_WORKSPACE_CONFIG=:4096:8
pack() {  # a report (.md) to OUT_DIR, its .json and the logs into the logs' archive
  [ -z "${1:-}" ] || cp "$logs/$1" "$out/" 2>/dev/null
  tar czf "$out/logs_$card.tgz" -C "$logs" .
}
if [ -d .whl ]; then
  ls .whl >"$logs/wheels.txt"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$logs/pip.log" 2>&1 || echo "wheels did not install: see pip.log in logs_$card.tgz"
else
  echo "no .whl/: the TorchRec checks and benchmarks.gpu_torchrec will not run" \
    | tee "$logs/wheels.txt"
fi
# An uninstalled copy: the folder pipelines/ is imported as robe_torchrec.pipelines, which an
# install maps (pyproject's package-dir) and a link does here.
[ -e robe_torchrec/pipelines ] || ln -s ../pipelines robe_torchrec/pipelines
export PYTHONPATH=/tmp/site:.
python3 -c "import torchrec" 2>>"$logs/wheels.txt" \
  || echo "torchrec does not import: its checks are left out (see wheels.txt)" | tee -a "$logs/wheels.txt"
failed=0
# the speed first, in a process of its own, as a training loop without torch.compile runs
# (the checks compile and load Inductor's CUDA graph trees)
timeout 90 python3 -m benchmarks.gpu_check --skip-checks --reps 10 --inner 3 \
  --out "$logs/gpu_speed_$card.md" >"$logs/gpu_speed.log" 2>&1 || failed=$((failed + 1))
pack "gpu_speed_$card.md"
# the checks stop starting after 100 s, so the last one started ends within the 130
timeout 130 python3 -m benchmarks.gpu_check --skip-speed --matrix 12 --checks-budget 100 \
  --out "$logs/gpu_check_$card.md" >"$logs/gpu_check.log" 2>&1 || failed=$((failed + 1))
pack "gpu_check_$card.md"
timeout 40 python3 -m benchmarks.host_overhead --cuda --reps 20 \
  --out "$logs/host_overhead_$card.md" >"$logs/host_overhead.log" 2>&1 || failed=$((failed + 1))
pack "host_overhead_$card.md"
timeout 150 python3 -m benchmarks.gpu_torchrec.run --commit "$commit" \
  --out "/tmp/robe_pipelines/gpu_pipelines_$card.md" >"$logs/gpu_torchrec.log" 2>&1 \
  || failed=$((failed + 1))
rm -rf /tmp/robe_pipelines/*_app
tar czf "$out/pipelines_$card.tgz" -C /tmp/robe_pipelines .
pack
if command -v ncu >/dev/null; then
  # the clocks left as they are (ncu locks them to base by default), its table to a file
  # it writes as it goes
  timeout 45 ncu --csv --clock-control none --log-file "$out/ncu_$card.csv" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --launch-count 30 \
    -k regex:"forward|backward|hash_starts|gather|optimizer" \
    python3 -m benchmarks.gpu_check --profile-launches >"$logs/ncu.log" 2>&1 \
    || failed=$((failed + 1))
else
  echo "ncu is not on PATH: no profile" | tee "$logs/ncu.log"
fi
pack
echo "$failed part(s) failed"
exit "$failed"
