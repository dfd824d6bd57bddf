"""GPU child program for tests/gpu/test_command_buffers_cuda.py: a jitted decode step (low-latency dispatch fp8 ->
an expert transform -> low-latency combine) on every GPU of one process, under the XLA_FLAGS the test sets.

Prints `RESULT decode ...` with: the step's wall time when each call is waited for (latency) and when 100 calls are
queued (throughput), a checksum of the output, how many of jax_ep's kernel-launching handlers were called per step
in those 100 (0 when XLA replays them from a command buffer, i.e. a CUDA graph; 2 per GPU when it calls them), and
from a profile of 20 steps jax_ep's device kernels per step.
"""
import argparse
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
from jax_ep import _native  # noqa: E402
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


y = jax.block_until_ready(step(x, idx, w))
y = jax.block_until_ready(step(x, idx, w))  # the second execution records the command buffer, if any
checksum = float(np.asarray(jnp.sum(jnp.abs(y.astype(jnp.float32)))))

latency = []
for _ in range(50):
    t0 = time.perf_counter()
    jax.block_until_ready(step(x, idx, w))
    latency.append((time.perf_counter() - t0) * 1e6)
calls_before = _native.module().launching_handler_calls()
t0 = time.perf_counter()
out = None
for _ in range(100):
    out = step(x, idx, w)
jax.block_until_ready(out)
throughput = (time.perf_counter() - t0) * 1e6 / 100
handler_calls = (_native.module().launching_handler_calls() - calls_before) / 100

steps = 20
events = trace_events(step, (x, idx, w), iterations=steps)
procs = {ev["pid"]: ev.get("args", {}).get("name", "") for ev in events
         if ev.get("ph") == "M" and ev.get("name") == "process_name"}
device = [ev for ev in events if ev.get("ph") == "X" and "GPU" in procs.get(ev.get("pid"), "")]
jax_ep_kernels = sum(1 for ev in device if "low_latency" in ev.get("name", ""))
result("decode", variant=a.variant, tokens=T, ranks=R, checksum=f"{checksum:.6e}",
       latency_us=f"{statistics.median(latency):.1f}", throughput_us=f"{throughput:.1f}",
       handler_calls_per_step=f"{handler_calls:.2f}",
       jax_ep_kernels_per_step=f"{jax_ep_kernels / steps:.2f}")
