#!/usr/bin/env bash
# On the 4-GPU machine (device tool): build, run the example on the GPUs, then the benchmark; logs under $OUT.
# Usage: bash scripts/gpu_bench.sh [bench args...]
set -uo pipefail
OUT=${OUT:-/tmp/jax_ep_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.6
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpus.txt" 2>&1
if [ ! -f .built ]; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  touch .built
fi
python3 -c "import jax_ep._native as n; print('native:', n.available(), n.load_error())"
python3 examples/moe_layer.py --steps 10 2>&1 | tee "$OUT/example.log" | tail -4
python3 -m jax_ep.bench --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" 
