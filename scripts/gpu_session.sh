#!/usr/bin/env bash
# One device call: build, GPU tests (both process models), examples, benchmark. Logs under $OUT.
#   BENCH_ARGS="..."      extra arguments of python -m jax_ep.bench (default: its GPU defaults)
#   SKIP_TESTS=1          build + examples + benchmark only
#   CPU_SUITE=1           also run the CPU suite's gradient / vjp / program / error tests on the GPUs
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
S="$OUT/summary.txt"; : > "$S"
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s: $(grep -E 'passed|failed|went|decode step|error' "$OUT/$name.log" | tail -1)" | tee -a "$S"; }
run build 240 python3 -m pip install --no-build-isolation --no-deps -e . -v
[ "${SKIP_TESTS:-0}" = 1 ] || run gpu_tests 300 python3 -m pytest -p no:cacheprovider -q -rs tests/test_native_build.py tests/gpu
[ "${CPU_SUITE:-0}" = 1 ] && run cpu_suite_on_gpus 240 python3 -m pytest -p no:cacheprovider -q -rs tests/test_gradients.py tests/test_vjp_rules.py tests/test_programs.py tests/test_errors.py
run example 120 python3 examples/moe_layer.py --steps 10
run example_ll 120 python3 examples/moe_layer.py --mode low_latency
run bench 400 python3 -m jax_ep.bench --out "$OUT/bench" ${BENCH_ARGS:-}
grep -E "^\||kernel\)" "$OUT/bench.log" | grep -v "^\[" | tee -a "$S"
