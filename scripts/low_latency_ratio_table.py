"""The table of `scripts/gpu.sh low-latency-ratio`: per (T, op), the median time of each configuration over the
repetitions and its ratio to the first configuration, from RESULTS/<rep>_<config>/results.json of jax_ep.bench.

    python3 scripts/low_latency_ratio_table.py RESULTS CONFIG [CONFIG...]      (e.g. /tmp/jax_ep_gpu/ratio nvl8 nvl1)
"""

import glob
import json
import os
import statistics
import sys

res, configs = sys.argv[1], sys.argv[2:]
times = {}  # (T, name) -> config -> [us]
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
if not times:
    sys.exit(f"no timings under {res}")
