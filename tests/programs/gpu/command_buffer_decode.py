"""GPU child program for tests/gpu/test_command_buffers_cuda.py: a jitted decode step (low-latency dispatch fp8 ->
an expert transform -> low-latency combine) on every GPU of one process, under the XLA_FLAGS the test sets.

Prints `RESULT decode ...` with: the step's wall time when each call is waited for (latency) and when 100 calls are
queued (throughput), a checksum of the output, where jax_ep's custom calls sit in the optimized HLO (inside XLA
command buffers, i.e. CUDA graphs, or not), and from a profile of 20 steps jax_ep's device kernels per step.
"""
import argparse
import re
import statistics
import time

from _child import prepare, reporter

prepare()
ap = argparse.ArgumentParser()
ap.add_argument("--variant", required=True)
ap.add_argument("--tokens", type=int, default=1)
a = ap.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.bench.kernel_times import trace_events  # noqa: E402

result = reporter(0)
devices = jax.devices()
R, T, H, K = len(devices), a.tokens, 7168, 8
E = 288 if 288 % R == 0 else 32 * R
mesh = Mesh(np.array(devices), ("ep",))
cfg = jax_ep.EPConfig(E, H, K, T, low_latency_buffers=True)
jax_ep.initialize(mesh, cfg)
sharding = NamedSharding(mesh, P("ep"))
rng = np.random.default_rng(0)
x = jax.device_put(jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16), sharding)
idx = jax.device_put(np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32), sharding)
w = jax.device_put(rng.uniform(0, 1, (R * T, K)).astype(np.float32), sharding)


def decode(x, idx, w):
    out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
    expert_out = (out.recv_x.astype(jnp.float32) * jnp.repeat(out.recv_x_scales, 128, axis=2) * 0.5
                  ).astype(jnp.bfloat16)
    return jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)


step = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))).lower(x, idx, w).compile()


def custom_calls_by_place(hlo: str) -> tuple[int, int]:
    """(jax_ep custom calls inside command-buffer computations, jax_ep custom calls elsewhere) of optimized HLO."""
    inside = outside = 0
    for block in re.split(r"\n(?=\S)", hlo):  # one computation per block: its header starts a line
        n = len(re.findall(r'custom_call_target="jax_ep_', block))
        if re.match(r"%?command_buffer", block):
            inside += n
        else:
            outside += n
    return inside, outside


in_cmd, out_cmd = custom_calls_by_place(step.as_text())
y = jax.block_until_ready(step(x, idx, w))
y = jax.block_until_ready(step(x, idx, w))  # the second execution records the command buffer, if any
checksum = float(np.asarray(jnp.sum(jnp.abs(y.astype(jnp.float32)))))

latency = []
for _ in range(50):
    t0 = time.perf_counter()
    jax.block_until_ready(step(x, idx, w))
    latency.append((time.perf_counter() - t0) * 1e6)
t0 = time.perf_counter()
out = None
for _ in range(100):
    out = step(x, idx, w)
jax.block_until_ready(out)
throughput = (time.perf_counter() - t0) * 1e6 / 100

steps = 20
events = trace_events(step, (x, idx, w), iterations=steps)
procs = {ev["pid"]: ev.get("args", {}).get("name", "") for ev in events
         if ev.get("ph") == "M" and ev.get("name") == "process_name"}
device = [ev for ev in events if ev.get("ph") == "X" and "GPU" in procs.get(ev.get("pid"), "")]
jax_ep_kernels = sum(1 for ev in device if "low_latency" in ev.get("name", ""))
result("decode", variant=a.variant, tokens=T, ranks=R, checksum=f"{checksum:.6e}",
       latency_us=f"{statistics.median(latency):.1f}", throughput_us=f"{throughput:.1f}",
       custom_calls_in_command_buffers=in_cmd, custom_calls_outside=out_cmd,
       jax_ep_kernels_per_step=f"{jax_ep_kernels / steps:.2f}")
