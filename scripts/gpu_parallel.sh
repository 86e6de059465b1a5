#!/usr/bin/env bash
# The parallelism GPU pass (issue 6) in one device call on a 2-GPU kind (nvidia-h200-x2):
# the single-GPU correctness tests, the tensor/pipeline-parallel tests on NCCL, then
# llama3-8b throughput and batch-1 latency at TP=1, TP=2 and PP=2, and a short table.
# A test run that outlives its watchdog gets every Python process's stack dumped
# (faulthandler on SIGABRT) and the process tree listed, so a hang names its place.
# Usage (device machine, repo root): scripts/gpu_parallel.sh [STAGES]  (tests,ptests,bench)
set -uo pipefail
export PYTHONPATH=/tmp/site:src:. PAGEDLLM_TEST_TOKENIZER_DIR=.gpu/tokenizer HF_HUB_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0
[ -f .gpu/commit ] && export PAGEDLLM_COMMIT=$(cat .gpu/commit)
OUT=${OUT:-/tmp/pagedllm-out}
mkdir -p "$OUT"
STAGES=",${1:-tests,ptests,bench},"
stage() { [[ "$STAGES" == *",$1,"* ]]; }
RES="$OUT/results.jsonl"
: > "$RES"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if ls .whl/*.whl >/dev/null 2>&1; then  # the server's packages, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi

watched() {  # name, limit in seconds, then the command
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  while kill -0 $pid 2>/dev/null && (( SECONDS - t0 < limit )); do sleep 2; done
  if kill -0 $pid 2>/dev/null; then
    echo "   $name still running after ${limit} s: process tree and stacks in $name.hang"
    ps -eo pid,ppid,stat,etimes,args --forest | grep -v " ps " > "$OUT/$name.hang"
    pkill -ABRT -f "python" ; sleep 5
    pkill -KILL -f "python" ; sleep 1
  fi
  wait $pid; local rc=$?
  echo "   ($name: rc=$rc, $((SECONDS - t0)) s)"
  grep -E "passed|failed|error" "$OUT/$name.log" | tail -3 | cut -c1-300
  grep '^{' "$OUT/$name.log" >> "$RES"
  return 0
}

stage tests && watched tests 240 python -m pytest -q -x -p no:cacheprovider tests/attention tests/ops tests/sample \
  tests/gpu tests/engine/test_correctness.py tests/engine/test_async_scheduling.py
stage ptests && watched tp_tests 300 python -m pytest -q -p no:cacheprovider -W ignore tests/distributed/test_tensor_parallel.py
stage ptests && watched pp_tests 300 python -m pytest -q -p no:cacheprovider -W ignore tests/distributed/test_pipeline_parallel.py
if stage bench; then
  for par in tp1 tp2 pp2; do
    case $par in
      tp1) ea="" ;;
      tp2) ea="tensor_parallel_size=2" ;;
      pp2) ea="pipeline_parallel_size=2" ;;
    esac
    watched "throughput_$par" 200 python -m pagedllm.benchmarks.throughput --shape llama3-8b ${ea:+--engine-args $ea}
    watched "latency_$par" 150 python -m pagedllm.benchmarks.latency --shape llama3-8b --batch-sizes 1 \
      ${ea:+--engine-args $ea}
  done
fi
echo "== results"
python - "$RES" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keep = {k: v for k, v in r.items() if k not in ("commit", "device", "time")}
    print(json.dumps(keep)[:400])
PY
