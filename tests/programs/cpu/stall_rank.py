"""Child program for tests/test_launch.py: one rank stalls (alive, heartbeating) after the first jax_ep step.

    python -m jax_ep.launch -n 2 --no-gpu-pinning tests/programs/cpu/stall_rank.py --stall-rank 1 --timeout 5 \
        --op {dispatch,low_latency_dispatch}

Every rank runs one reference-backend step (dispatch + combine, low-latency dispatch + combine) over a 1-D mesh of
all processes and prints `STEP 1 done`. Then --stall-rank sleeps (300 s) while the others run the --op again: its
arrival check must end the wait within EPConfig.timeout_seconds with an EPError naming the op and the stalled
rank (printed as `ARRIVAL_ERROR <seconds> <message>`), after which this process exits with code 7 and the launcher
ends the stalled one.
"""
import argparse
import os
import sys
import time

from _child import global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--stall-rank", type=int, default=1)
ap.add_argument("--timeout", type=float, default=5.0)
ap.add_argument("--op", choices=["dispatch", "low_latency_dispatch"], default="dispatch")
a = ap.parse_args()
pid, nproc = join_job("cpu", 1)

import jax  # noqa: E402

import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

G = jax.device_count()
T, H, K, E = 4, 16, 2, 2 * G
devices = global_devices()
mesh = Mesh(np.array(devices), ("ep",))
cfg = jax_ep.EPConfig(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, backend="reference",
                      timeout_seconds=a.timeout)
jax_ep.initialize(mesh, cfg)
sh = NamedSharding(mesh, P("ep"))
x = jax.make_array_from_process_local_data(sh, np.ones((T, H), np.float32).astype(jnp.bfloat16), (G * T, H))
idx = jax.make_array_from_process_local_data(sh, (np.arange(T * K).reshape(T, K) % E).astype(np.int32), (G * T, K))
w = jax.make_array_from_process_local_data(sh, np.full((T, K), 0.5, np.float32), (G * T, K))


def normal(x, idx, w):
    out = jax_ep.dispatch(x, idx, w, cfg)
    return jax_ep.combine(out.recv_x, out.handle, cfg)[0][:1, :1].astype(jnp.float32)


def low_latency(x, idx, w):
    out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
    return jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, cfg)[:1, :1].astype(jnp.float32)


spec = (P("ep"), P("ep"), P("ep"))
steps = {"normal": jax.jit(jax.shard_map(normal, mesh=mesh, in_specs=spec, out_specs=P("ep"))),
         "low_latency": jax.jit(jax.shard_map(low_latency, mesh=mesh, in_specs=spec, out_specs=P("ep")))}
for step in steps.values():
    jax.block_until_ready(step(x, idx, w))
print("STEP 1 done", flush=True)

if pid == a.stall_rank:
    print(f"rank {pid} stalling", flush=True)
    time.sleep(300)
    sys.exit(0)

t0 = time.monotonic()
try:
    jax.block_until_ready(steps["low_latency" if a.op == "low_latency_dispatch" else "normal"](x, idx, w))
except Exception as e:  # the arrival error surfaces as the call's runtime error
    line = next((ln for ln in str(e).splitlines() if "did not arrive" in ln), str(e).splitlines()[-1])
    print(f"ARRIVAL_ERROR {time.monotonic() - t0:.1f} {line.strip()}", flush=True)
    os._exit(7)  # no atexit: JAX's exit hooks would re-raise the callback error
print("STEP 2 returned (unexpected)", flush=True)
