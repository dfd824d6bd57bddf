#!/usr/bin/env bash
# A/B of the low-latency bench on one machine: the tree in $OLD (e.g. `git archive REV | tar -x -C ab_old`) against
# this one, each built and run at EP2 with --nvl 8 (NVLink kernels) and --nvl 1 (NVSHMEM kernels). Logs under $OUT;
# prints rank 0's jax_ep rows and kernel phases.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"; ROOT=$PWD
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
for tag in ${ORDER:-old new}; do
  [ "$tag" = old ] && dir=$ROOT/${OLD:-ab_old} || dir=$ROOT
  (cd "$dir" && python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build_$tag.log" 2>&1) || echo "build $tag failed"
  for nvl in 8 1; do
    (cd "$dir" && NVSHMEM_SYMMETRIC_SIZE=12G timeout 150 python3 -m jax_ep.launch -n 2 -m jax_ep.bench --mode low_latency \
      --ll-tokens ${LL_TOKENS:-1,32,128} --loops 15 --nvl $nvl --out "$OUT/b_${tag}_$nvl" > "$OUT/ab_${tag}_nvl$nvl.log" 2>&1)
    echo "== $tag nvl=$nvl rc=$?"
    grep "^\[rank 0\] |" "$OUT/ab_${tag}_nvl$nvl.log" | grep -E "jax_ep LL|kernel" | cut -c10-90
  done
done
