#!/usr/bin/env bash
# One device call for the one-process-per-GPU model: build, NVSHMEM checks, GPU tests, prewarm measurement.
# Logs under $OUT; a summary line per step in $OUT/summary.txt.
#   STEPS="build tests prewarm" (default)   PYTEST_K=<pytest -k expression>   PREWARM_ARGS="--tokens 4096 ..."
#   WARMUP_AB=1: the prewarm step instead runs eager mode in both process models with initialize's warm-up
#   execution on and off (--no-warmup-ops), each with XLA's preallocation off and on (MEM_FRACTION 0.5)
#   PREBUILT=<dir with _jax_ep_native*.so and _jax_ep_nvshmem*.so built on the same image>: on a fresh machine (no
#   build/ directory) skip the build: copy them into jax_ep/ and run from the source tree. After a build both
#   modules are copied to $OUT for that.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STEPS=${STEPS:-build tests prewarm}
S="$OUT/summary.txt"; : > "$S"
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|error|Error|PREWARM' "$OUT/$name.log" | tail -1 | cut -c1-300)" | tee -a "$S"; }

# A warm machine still has the build directory (an incremental build takes seconds): build then, prebuilt otherwise.
if [ -n "${PREBUILT:-}" ] && ! ls -d build/cp3* >/dev/null 2>&1; then
  cp "$PREBUILT"/_jax_ep_*.so jax_ep/ && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  echo "prebuilt: $(ls jax_ep/*.so | tr '\n' ' ')" | tee -a "$S"
elif [[ " $STEPS " == *" build "* ]]; then
  run build 200 python3 -m pip install --no-build-isolation --no-deps -e . -v
  grep -E "^jax_ep:|-- jax_ep:" "$OUT/build.log" | tee -a "$S"
  cp build/cp3*/_jax_ep_native*.so build/cp3*/_jax_ep_nvshmem*.so "$OUT/" 2>/dev/null
fi
python3 -c "import jax_ep._native as n, jax_ep.runtime.nvshmem as m; print('native', n.available(), n.load_error()); print('nvshmem', m.availability())" 2>&1 | tee -a "$S"

if [[ " $STEPS " == *" tests "* ]]; then
  run mp_tests 220 python3 -m pytest -p no:cacheprovider -q -rs -s tests/gpu/test_multiprocess_cuda.py ${PYTEST_K:+-k "$PYTEST_K"}
  grep -E "^\\$|RESULT (runtime|teams|mismatch)" "$OUT/mp_tests.log" | cut -c1-260 | head -40 | tee -a "$S"
fi
if [[ " $STEPS " == *" prewarm "* ]]; then
  # Both process models, eager (initialize first) and lazy (trace-time init); then eager again with CUDA's eager
  # module loading and with XLA command buffers off, to see where the first call's extra time goes.
  N=$(nvidia-smi -L | grep -c '^GPU ')
  P="$OUT/prewarm.log"; : > "$P"
  pw() { local name=$1; shift; timeout --kill-after=10 120 "$@" > "$OUT/pw.tmp" 2>&1; echo "$name rc=$?" >> "$P"
         grep -E "PREWARM|^\| |^\[rank 0\] \| " "$OUT/pw.tmp" >> "$P"; }
  if [ "${WARMUP_AB:-0}" = 1 ]; then
    # what initialize's warm-up execution buys: on / off, with XLA's preallocation off and on
    for prealloc in "XLA_PYTHON_CLIENT_PREALLOCATE=false" \
                    "XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.5"; do
      for ops in "" "--no-warmup-ops"; do
        pw "single eager $prealloc ${ops:-warmup_ops}" env $prealloc python3 -m jax_ep.bench.prewarm --mode eager \
          $ops ${PREWARM_ARGS:-}
        pw "multi eager $prealloc ${ops:-warmup_ops}" env $prealloc python3 -m jax_ep.launch -n "$N" --timeout 110 \
          -m jax_ep.bench.prewarm --mode eager $ops ${PREWARM_ARGS:-}
      done
    done
  else
    for mode in eager lazy; do
      pw "single $mode" python3 -m jax_ep.bench.prewarm --mode $mode ${PREWARM_ARGS:-}
      pw "multi $mode" python3 -m jax_ep.launch -n "$N" --timeout 110 -m jax_ep.bench.prewarm --mode $mode \
        ${PREWARM_ARGS:-}
    done
    for v in "CUDA_MODULE_LOADING=EAGER" "XLA_FLAGS=--xla_gpu_enable_command_buffer="; do
      pw "single eager $v" env "$v" python3 -m jax_ep.bench.prewarm --mode eager ${PREWARM_ARGS:-}
      pw "multi eager $v" env "$v" python3 -m jax_ep.launch -n "$N" --timeout 110 -m jax_ep.bench.prewarm \
        --mode eager ${PREWARM_ARGS:-}
    done
  fi
  rm -f "$OUT/pw.tmp"
  grep -h "rc=\|^| \|^\[rank 0\] | " "$P" | tee -a "$S"
fi
