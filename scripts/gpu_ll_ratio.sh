#!/usr/bin/env bash
# The low-latency NVSHMEM/NVLink time ratio at EP2 with less noise than one bench run: REPS alternations of the
# configurations in CONFIGS (nvl8 = NVLink kernels; nvl1 = NVSHMEM kernels between 2 simulated nodes of 1;
# nvl1:BYTES = the same with JAX_EP_LL_PUT_BYTES=BYTES), each `--calls CALLS` chained calls per loop (a 20-call loop
# is ~1 ms at T=1, where the two processes' start skew alone gave 70-170% spread). Prints, per (T, op), the median
# time of each configuration over the repetitions and its ratio to the first configuration. Needs 2 GPUs.
# Results under /tmp (the device returns only 8 files); the table and one log per configuration under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
CONFIGS=${CONFIGS:-nvl8 nvl1}; RES=/tmp/ll_ratio; rm -rf "$RES"; mkdir -p "$RES"
for rep in $(seq 1 "${REPS:-3}"); do
  for cfg in $CONFIGS; do
    nvl=${cfg%%:*}; nvl=${nvl#nvl}; [[ "$cfg" == *:* ]] && put=${cfg#*:} || put=""
    env NVSHMEM_SYMMETRIC_SIZE=12G ${put:+JAX_EP_LL_PUT_BYTES=$put} timeout 150 python3 -m jax_ep.launch -n 2 \
      -m jax_ep.bench --mode low_latency --ll-tokens "${LL_TOKENS:-1,32,128}" --only "jax_ep LL" \
      --calls "${CALLS:-100}" --loops "${LOOPS:-10}" --nvl "$nvl" --out "$RES/${rep}_$cfg" > "$OUT/ratio_$cfg.log" 2>&1
    echo "rep $rep $cfg rc=$?"
  done
done
python3 - "$RES" $CONFIGS <<'EOF' | tee "$OUT/ratio_table.txt"
import glob, json, os, statistics, sys
res, configs = sys.argv[1], sys.argv[2:]
times = {}  # (T, name) -> cfg -> [us]
for path in glob.glob(os.path.join(res, "*", "results.json")):
    cfg = os.path.basename(os.path.dirname(path)).split("_", 1)[1]
    for r in json.load(open(path))["results"]:
        if "us" in r:
            times.setdefault((r["tokens"], r["name"]), {}).setdefault(cfg, []).append(r["us"])
print("| T | op | " + " | ".join(f"{c} us (runs)" for c in configs) + " | " +
      " | ".join(f"{c}/{configs[0]}" for c in configs[1:]) + " |")
for (t, name), by in sorted(times.items()):
    med = {c: statistics.median(v) for c, v in by.items()}
    cells = [f"{med[c]:.1f} ({', '.join(f'{u:.0f}' for u in by[c])})" if c in med else "-" for c in configs]
    ratios = [f"{med[c] / med[configs[0]]:.2f}x" if c in med and configs[0] in med else "-" for c in configs[1:]]
    print(f"| {t} | {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
EOF
