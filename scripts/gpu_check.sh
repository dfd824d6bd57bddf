#!/usr/bin/env bash
# Build + GPU tests + command-buffer variants + timing (+ sanitizers) of the intranode CUDA backend, in one go.
# Logs go to $OUT (default ./gpu_out). Each stage has its own time limit and the script keeps going after a
# failure, so one call returns everything; summary.txt has one line per stage.
#
# usage: scripts/gpu_check.sh [stage ...]   stages: build tests cmdbuf bench memcheck racecheck
#        (default: build tests cmdbuf bench)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off; jax_ep allocates its own staging, so XLA must not take 75% of the memory up front.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
STAGES=${*:-build tests cmdbuf bench}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

stage() {  # stage NAME TIMEOUT_S LOG CMD...
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$SUMMARY"
  return $rc
}

{
  nvidia-smi -L
  nvidia-smi topo -m 2>/dev/null | head -8
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} >"$OUT/env.log" 2>&1

for s in $STAGES; do
  case $s in
    build)
      stage build 240 "$OUT/build.log" $PY -m pip install --no-build-isolation --no-deps -e . -v
      grep -h "jax_ep:" "$OUT/build.log" | head -2 | tee -a "$SUMMARY"
      $PY -c "import jax_ep._native as n; print('native:', n.info())" 2>&1 | tail -1 | tee -a "$SUMMARY"
      ;;
    tests)
      stage tests 300 "$OUT/tests.log" $PY -m pytest -p no:cacheprovider -q -rs -s tests/test_native_build.py tests/gpu
      grep -E "passed|failed|error" "$OUT/tests.log" | tail -2 | tee -a "$SUMMARY"
      ;;
    cmdbuf)
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
        stage cmdbuf_off 120 "$OUT/cmdbuf.log" $PY -m pytest -p no:cacheprovider -q -s tests/gpu -k scan
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL" \
        stage cmdbuf_custom_call 120 "$OUT/cmdbuf.log" $PY -m pytest -p no:cacheprovider -q -s tests/gpu -k scan
      grep -E "command buffers in|scan:|passed|failed" "$OUT/cmdbuf.log" | tee -a "$SUMMARY"
      ;;
    bench)
      stage bench 150 "$OUT/bench.log" $PY tests/gpu/bench_intranode.py 4 4096 7168 8 256
      grep -E '"us"|error|skipped' "$OUT/bench.log" | tee -a "$SUMMARY"
      ;;
    memcheck|racecheck)
      CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" \
        stage "$s" 150 "$OUT/sanitizer.log" "$CS" --tool "$s" --target-processes all --print-limit 20 \
        $PY tests/gpu/sanitize_small.py
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_small" "$OUT/sanitizer.log" | tail -4 | tee -a "$SUMMARY"
      ;;
    *) echo "unknown stage $s" | tee -a "$SUMMARY" ;;
  esac
done
