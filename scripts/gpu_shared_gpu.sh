#!/usr/bin/env bash
# EP groups with more ranks than GPUs: several NVSHMEM PEs (processes) per GPU through the CUDA MPS daemon
# (`jax_ep.launch --processes-per-gpu P`). NVSHMEM gives full support to several PEs per GPU only while MPS runs
# (without it, team splits and barriers exit). The daemon is started here as a user process (no GPU mode, clock or
# setting changes) and stopped at the end. Runs the tests of tests/gpu/test_multiprocess_cuda.py selected by
# SHARED_K (default: test_group_larger_than_the_gpus_across_simulated_hosts, its cases in SHARED_GPU_CASES).
# Logs under $OUT; the summary on stdout. BUILD=0 skips the build.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
S="$OUT/summary_shared.txt"; touch "$S"
nvidia-smi -L >> "$S" 2>&1
if [ "${BUILD:-1}" = 1 ]; then
  t0=$SECONDS; python3 -m pip install --no-build-isolation --no-deps -e . -v > "$OUT/build.log" 2>&1
  echo "build rc=$? $((SECONDS - t0))s" | tee -a "$S"
fi
MPS=$(command -v nvidia-cuda-mps-control || true)
echo "mps control: ${MPS:-none}" | tee -a "$S"
if [ -n "$MPS" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/jax_ep_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/jax_ep_mps_log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  "$MPS" -d; echo "mps start rc=$?" | tee -a "$S"
fi
t0=$SECONDS
timeout --kill-after=10 ${SHARED_LIMIT:-500} python3 -m pytest -p no:cacheprovider -q -rs -s \
  tests/gpu/test_multiprocess_cuda.py -k "${SHARED_K:-larger_than_the_gpus}" > "$OUT/shared.log" 2>&1
echo "shared rc=$? $((SECONDS - t0))s: $(grep -E 'passed|failed' "$OUT/shared.log" | tail -1)" | tee -a "$S"
grep -E "^\\$|RESULT (normal|low_latency|done) |FAILED|Error" "$OUT/shared.log" | cut -c1-300 | head -60 | tee -a "$S"
# SHARED_SAN="memcheck racecheck": compute-sanitizer on the normal-mode program at R=4 (2 processes per GPU), nodes of
# 2 (hierarchical dispatch: the forward kernel), while the daemon runs. NOTE (2x H100, 2026-11-25): it does not work:
# the sanitized processes never met at the first barrier (60 s timeout; two sanitized MPS clients of one GPU do not
# run concurrently). Kept for a retry with a newer sanitizer; on a 4-GPU kind run the same program without MPS:
# JAX_EP_SANITIZE_NVL=2 compute-sanitizer ... python3 -m jax_ep.launch -n 4 tests/gpu/sanitize_normal_small.py
for tool in ${SHARED_SAN:-}; do
  t0=$SECONDS
  timeout --kill-after=10 150 env JAX_EP_TRANSPORT=nvshmem JAX_EP_SANITIZE_NVL=2 compute-sanitizer --tool "$tool" \
    --report-api-errors no --kernel-name kns=rdma_ python3 -m jax_ep.launch -n 4 --processes-per-gpu 2 --timeout 140 \
    tests/gpu/sanitize_normal_small.py > "$OUT/shared_san_$tool.log" 2>&1
  echo "shared_san_$tool rc=$? $((SECONDS - t0))s: $(grep -E 'SUMMARY|OK|rror' "$OUT/shared_san_$tool.log" | sort | uniq -c | head -4 | tr '\n' ' ')" | tee -a "$S"
done
[ -n "$MPS" ] && { echo quit | "$MPS"; echo "mps stop rc=$?" | tee -a "$S"; }
