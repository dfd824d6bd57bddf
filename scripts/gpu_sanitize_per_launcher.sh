#!/usr/bin/env bash
# compute-sanitizer on an N-process NVSHMEM job with one sanitizer per process: N launcher invocations on this host
# (as on N hosts: -n 1 --num-hosts N --host-index h --coordinator), each with CUDA_VISIBLE_DEVICES=h and its own
# compute-sanitizer. One sanitizer following all N children of `jax_ep.launch -n N` segfaulted at N=4
# (compute-sanitizer itself, rc 139, 2026-11-26); per-process sanitizers avoid that.
#   TOOL=memcheck|racecheck  N=4  PROG="tests/gpu/sanitize_normal_small.py"  KERNELS=kns=rdma_ ("" = every kernel)
# Extra environment (JAX_EP_SANITIZE_NVL=2 for the forwarding kernels) passes through. Logs: $OUT/san_<tool>_h<h>.log
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
TOOL=${TOOL:-memcheck}; N=${N:-4}; KERNELS=${KERNELS-kns=rdma_}
[ -n "$KERNELS" ] && kfilter=(--kernel-name "$KERNELS") || kfilter=()
port=$(python3 -c "from jax_ep.launch.plan import free_port; print(free_port())")
pids=()
for h in $(seq $((N - 1)) -1 0); do  # host 0 (the coordinator) last, as the two-launcher test does
  CUDA_VISIBLE_DEVICES=$h JAX_EP_TRANSPORT=nvshmem timeout 150 compute-sanitizer --tool "$TOOL" \
    --report-api-errors no "${kfilter[@]}" python3 -m jax_ep.launch -n 1 --num-hosts "$N" --host-index "$h" \
    --coordinator "127.0.0.1:$port" --timeout 140 ${PROG:-tests/gpu/sanitize_normal_small.py} \
    > "$OUT/san_${TOOL}_h$h.log" 2>&1 &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for h in $(seq 0 $((N - 1))); do
  echo "h$h: $(grep -E 'SUMMARY|: OK$|Trapping|Segmentation|Traceback' "$OUT/san_${TOOL}_h$h.log" | tail -2 | tr '\n' ' ')"
done
echo "san per launcher $TOOL N=$N rc=$rc"
exit $rc
