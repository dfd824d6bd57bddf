"""A small low-latency run for compute-sanitizer (memcheck / racecheck): one process, R=2 GPUs, T=16, H=256, K=4,
E=8; fp8 and bf16 dispatch, combine, and the split phases, three rounds with new routing, on the CUDA backend via
jax_ep.initialize. Checks recv_count against NumPy and prints 'sanitize_ll_small: OK' at the end.

    compute-sanitizer --tool memcheck --kernel-name kns=ll_ python3 tests/gpu/sanitize_ll_small.py
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep


def main():
    R, T, H, K, E = 2, 16, 256, 4, 8
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < R:
        print(f"sanitize_ll_small skipped: needs {R} GPUs, found {len(gpus)}")
        return
    mesh = Mesh(np.array(gpus[:R]), ("ep",))
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda", timeout_seconds=60.0)
    jax_ep.initialize(mesh, cfg)

    def body(x, idx, w):
        a = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        b = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False), cfg)
        y = jax_ep.low_latency_combine(b.recv_x, idx, w, b.handle, cfg)
        y2 = jax_ep.low_latency_combine_recv(jax_ep.low_latency_combine_send(b.recv_x, idx, w, b.handle, cfg), cfg)
        return a.recv_count, b.recv_count, y, y2

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    rng = np.random.default_rng(0)
    for round_ in range(3):
        idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(R * T)]).astype(np.int32)
        idx[rng.random(idx.shape) < 0.2] = -1
        x = jnp.asarray(rng.normal(size=(R * T, H)), jnp.bfloat16)
        w = jnp.asarray(rng.random(size=idx.shape), jnp.float32)
        c8, c16, y, y2 = jax.device_get(f(x, jnp.asarray(idx), w))
        expect = [int((idx == e).sum()) for e in range(E)]  # rows per expert (no repeats in this routing)
        assert c8.tolist() == expect and c16.tolist() == expect, (c8, c16, expect)
        assert np.array_equal(np.asarray(y).view(np.uint16), np.asarray(y2).view(np.uint16))
        print(f"round {round_}: recv_count {expect}")
    jax_ep.finalize()
    print("sanitize_ll_small: OK")


if __name__ == "__main__":
    main()
