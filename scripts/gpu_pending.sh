#!/usr/bin/env bash
# One device call (2 GPUs, ~8 min) that verifies the branch next/pending (= next/node-first-combine +
# next/ll-put-parts, docs/pending/*.md): build; the multi-process NVSHMEM tests; the shared-GPU cases under MPS
# (node-first combine and the trimmed forwarding areas at 2 nodes of 2/4/8 and 4 of 8); the LL suite with larger
# counted messages; then the LL bench at EP2 (nodes of 1) for JAX_EP_LL_PUT_BYTES in $PUT_BYTES ("nvl:bytes" pairs,
# default 2 KB and 16 KB) and the NVLink baseline. Per-step limits keep the whole call under 560 s; the summary is printed as each step ends.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|rror' "$OUT/$name.log" | tail -2 | tr '\n' ' ')"; }
step build 120 python3 -m pip install --no-build-isolation --no-deps -e . -v
step mp 150 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_multiprocess_cuda.py -k "nvshmem or across"
BUILD=0 OUT="$OUT" SHARED_LIMIT=230 bash scripts/gpu_shared_gpu.sh > /dev/null 2>&1
grep -E "shared rc|FAILED|Error" "$OUT/summary_shared.txt" | head -8
step ll_big_parts 100 env JAX_EP_LL_PUT_BYTES=16384 python3 -m pytest -p no:cacheprovider -q \
  tests/gpu/test_low_latency_nvshmem.py
for nvl_b in 8:2048 ${PUT_BYTES:-1:2048 1:16384}; do
  nvl=${nvl_b%%:*} b=${nvl_b##*:}
  step "bench_nvl${nvl}_b$b" 60 env JAX_EP_LL_PUT_BYTES=$b NVSHMEM_SYMMETRIC_SIZE=12G python3 -m jax_ep.launch -n 2 \
    -m jax_ep.bench --mode low_latency --ll-tokens 1,32,128 --loops 15 --nvl $nvl --out "$OUT/bench_${nvl}_$b"
  grep -E "^\[rank 0\] \|.*jax_ep" "$OUT/bench_nvl${nvl}_b$b.log" | cut -c10-110 | sed "s/^/  nvl=$nvl bytes=$b: /"
done
