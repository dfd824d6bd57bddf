#!/usr/bin/env bash
# One device call for the NVSHMEM (internode) paths: build, the multi-process NVSHMEM tests first, the whole GPU
# suite, compute-sanitizer on simulated nodes (low-latency and normal mode), then (STEPS=bench) the EP-size
# benchmark of both paths.
# Logs and a summary under $OUT. STEPS: comma list of build,mp,suite,sanitize,bench,shared (default
# build,mp,suite,sanitize; shared: the several-processes-per-GPU cases under MPS, scripts/gpu_shared_gpu.sh).
#   SAN_TOOLS="memcheck"  sanitizer tools at n=N (default memcheck racecheck, plus memcheck at n=1 all-remote)
#   SUITE_FILES="..."  the suite's test files (default tests/test_native_build.py tests/gpu/test_*.py)
#   SAN_SCRIPTS="ll normal"  which small programs run under the sanitizer (sanitize_ll_small / _normal_small)
#   N=2             processes / GPUs for the sanitizer and bench runs (2 nodes of 1 with --nvl 1); N > 2: one
#                   sanitizer per process (scripts/gpu_sanitize_per_launcher.sh)
#   LL_TOKENS=...   low-latency token counts of the bench (default 1,32,128); TOKENS: normal mode's (default 4096)
#   BENCH_MODES="low_latency normal"  the bench's modes
#   SAN_KERNELS=kns=rdma_  compute-sanitizer's --kernel-name filter of every sanitizer run ("" = every kernel: the
#                   NVLink and reduce kernels of the same programs too)
#   PUT_SWEEP="4096 8192"  extra low-latency bench runs at --nvl 1 (jax_ep only), one per JAX_EP_LL_PUT_BYTES value
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
S="$OUT/summary.txt"; touch "$S"
SAN_KERNELS=${SAN_KERNELS-kns=rdma_}; [ -n "$SAN_KERNELS" ] && kfilter=(--kernel-name "$SAN_KERNELS") || kfilter=()
N=${N:-2}; STEPS=",${STEPS:-build,mp,suite,sanitize},"; LL_TOKENS=${LL_TOKENS:-1,32,128}
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|OK|ERROR SUMMARY|error' "$OUT/$name.log" | tail -2 | tr '\n' ' ')" | tee -a "$S"; }
has() { [[ "$STEPS" == *",$1,"* ]]; }
nvidia-smi -L >> "$S" 2>&1
has build && run build 240 python3 -m pip install --no-build-isolation --no-deps -e . -v
has mp && run mp_nvshmem 240 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_multiprocess_cuda.py \
  -k "nvshmem or two_launchers or across"
# the suite one file per process: a kernel that traps poisons its CUDA context, which would fail every later test
if has suite; then
  for f in ${SUITE_FILES:-tests/test_native_build.py tests/gpu/test_*.py}; do
    [ "$f" = tests/gpu/test_multiprocess_cuda.py ] && has mp && k=(-k "not (nvshmem or two_launchers or across)") || k=()
    run "suite_$(basename "$f" .py)" 200 python3 -m pytest -p no:cacheprovider -q -rs "$f" "${k[@]}"
  done
fi
if has sanitize; then
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    for script in ${SAN_SCRIPTS:-ll normal}; do
      [ "$script" = ll ] && prog=(tests/gpu/sanitize_ll_small.py nvshmem) || prog=(tests/gpu/sanitize_normal_small.py)
      if [ "$N" -gt 2 ]; then  # one sanitizer following N > 2 children segfaulted (rc 139, N=4): one per process
        run "san_${tool}_${script}_n${N}" 170 env TOOL=$tool N="$N" KERNELS="$SAN_KERNELS" PROG="${prog[*]}" \
          bash scripts/gpu_sanitize_per_launcher.sh
      else
        run "san_${tool}_${script}_n${N}" 120 env JAX_EP_TRANSPORT=nvshmem compute-sanitizer --tool $tool \
          --report-api-errors no "${kfilter[@]}" python3 -m jax_ep.launch -n "$N" --timeout 110 "${prog[@]}"
      fi
    done
  done
  # the NVSHMEM normal send kernel's 32-slot instance (R > 8) at R = N (test hook JAX_EP_TEST_WIDE_SEND)
  if [[ " ${SAN_SCRIPTS:-ll normal} " == *" normal "* ]]; then
    if [ "$N" -gt 2 ]; then
      run "san_memcheck_normal_wide_n${N}" 170 env JAX_EP_TEST_WIDE_SEND=1 TOOL=memcheck N="$N" \
        KERNELS="$SAN_KERNELS" PROG=tests/gpu/sanitize_normal_small.py bash scripts/gpu_sanitize_per_launcher.sh
    else
      run "san_memcheck_normal_wide_n${N}" 120 env JAX_EP_TRANSPORT=nvshmem JAX_EP_TEST_WIDE_SEND=1 compute-sanitizer \
        --tool memcheck --report-api-errors no "${kfilter[@]}" python3 -m jax_ep.launch -n "$N" --timeout 110 \
        tests/gpu/sanitize_normal_small.py
    fi
  fi
  [ -n "${SAN_TOOLS:-}" ] || run san_memcheck_n1_allremote 120 env JAX_EP_TRANSPORT=nvshmem JAX_EP_TEST_ALL_PEERS_REMOTE=1 compute-sanitizer \
    --tool memcheck --report-api-errors no "${kfilter[@]}" python3 -m jax_ep.launch -n 1 --timeout 110 \
    tests/gpu/sanitize_ll_small.py nvshmem
fi
if has bench; then
  # low-latency and normal mode, each through the NVLink kernels (--nvl 8) and the NVSHMEM kernels (--nvl 1);
  # normal mode: jax_ep only (the baselines are timed elsewhere); low-latency: with its kernel-time phases
  for mode in ${BENCH_MODES:-low_latency normal}; do
    [ "$mode" = low_latency ] && shape=(--ll-tokens "$LL_TOKENS") || shape=(--tokens "${TOKENS:-4096}" --only jax_ep)
    for nvl in 8 1; do
      run "bench_${mode}_nvl${nvl}_ep$N" 200 env NVSHMEM_SYMMETRIC_SIZE=12G python3 -m jax_ep.launch -n "$N" \
        -m jax_ep.bench --mode "$mode" "${shape[@]}" --loops 15 --nvl $nvl --out "$OUT/bench_${mode}_$nvl"
      grep -E "^\[rank 0\] \|.*(jax_ep|kernel)" "$OUT/bench_${mode}_nvl${nvl}_ep$N.log" | cut -c10-100 \
        | sed "s/^/${mode} nvl=$nvl: /" >> "$S"
    done
  done
  for bytes in ${PUT_SWEEP:-}; do
    run "bench_ll_put${bytes}_ep$N" 200 env NVSHMEM_SYMMETRIC_SIZE=12G JAX_EP_LL_PUT_BYTES="$bytes" python3 -m \
      jax_ep.launch -n "$N" -m jax_ep.bench --mode low_latency --ll-tokens "$LL_TOKENS" --only jax_ep --loops 15 --nvl 1 \
      --out "$OUT/bench_ll_put$bytes"
    grep -E "^\[rank 0\] \|.*(jax_ep|kernel)" "$OUT/bench_ll_put${bytes}_ep$N.log" | cut -c10-100 \
      | sed "s/^/put_bytes=$bytes nvl=1: /" >> "$S"
  done
fi
# groups larger than the GPUs (several processes per GPU under the CUDA MPS daemon): scripts/gpu_shared_gpu.sh
if has shared; then
  BUILD=0 OUT="$OUT" bash scripts/gpu_shared_gpu.sh > /dev/null 2>&1
  grep -E "shared rc|shared_san|^\\$" "$OUT/summary_shared.txt" >> "$S"
fi
cat "$S"
