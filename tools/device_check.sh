#!/usr/bin/env bash
# A device session's one prepared check (see docs/gpu.md): the GPU tests, the GPU sections
# of `make bench`, a short live replay on the GPU against the simulator, and the decode
# step's profile (eager against CUDA graphs): about 6 minutes on an H200, each part capped
# so the whole stays under 10. Run from the repository root with the device's own python3
# (torch, transformers, aiohttp there) and the wheels it lacks on PYTHONPATH; every part
# writes its log under $OUT (default /tmp/out).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TALARIA_CACHE=${TALARIA_CACHE:-/tmp/talaria-cache}
PY=${PY:-python3}
status=0
part() {  # part NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" = 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
part gpu_tests "${GPU_TESTS_S:-120}" $PY -m pytest -q -s -p no:cacheprovider -o addopts= tests/gpu
part bench "${BENCH_S:-220}" $PY -m talaria.bench --only device-steps --only engine --only switch --only multimodel
part live_replay "${REPLAY_S:-130}" $PY tools/device_check.py --sessions 12 --time-scale 0.05 \
  --json "$OUT/live_replay.json"
part profile "${PROFILE_S:-100}" $PY tools/device_profile.py
exit $status
