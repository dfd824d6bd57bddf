"""A small normal-mode run over NVSHMEM for compute-sanitizer (memcheck / racecheck): one process per GPU, R = the
processes (2: two simulated nodes of one GPU, num_max_nvl_peers=1, so the other rank is reached by NVSHMEM puts;
nvshmem/device/normal_send.cu, kernel names nvshmem_*), T=16, H=256, K=4, E=8: bf16 and fp8 dispatch, combine and
a gradient through both (cached dispatch), three rounds with new routing. Checks the received counts against NumPy
and the combine against the reference formula, and prints 'normal_nvshmem_small: OK' at the end.
JAX_EP_SANITIZE_NVL=k sets num_max_nvl_peers (default 1); k = 2 with 4 processes (`--processes-per-gpu 2` under
CUDA MPS on 2 GPUs) runs hierarchical dispatch (the forward kernel).

    JAX_EP_TRANSPORT=nvshmem compute-sanitizer --tool memcheck --kernel-name kns=nvshmem_ \
        python3 -m jax_ep.launch -n 2 tests/programs/sanitize/normal_nvshmem_small.py
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep


def _global(v, mesh):
    return jax.make_array_from_callback(v.shape, NamedSharding(mesh, P("ep")), lambda index: v[index])


def main():
    T, H, K, E = 16, 256, 4, 8
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    R = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    nvl = int(os.environ.get("JAX_EP_SANITIZE_NVL", "1"))
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda", timeout_seconds=60.0, num_max_nvl_peers=nvl,
                          low_latency_buffers=False)
    jax_ep.initialize(mesh, cfg)
    print(f"normal_over_nvshmem={cfg.normal_over_nvshmem(R)} R={R} num_max_nvl_peers={nvl}")

    def body(x, idx, w):
        o = jax_ep.dispatch(x, idx, w, cfg)
        q, qs = jax_ep.fp8.quantize_blocks(x)
        o8 = jax_ep.dispatch(q, idx, w, cfg, x_scales=qs)
        y, _ = jax_ep.combine(o.recv_x, o.handle, cfg, o.recv_topk_weights)

        def loss(x):
            oo = jax_ep.dispatch(x, idx, w, cfg)
            yy, _ = jax_ep.combine(oo.recv_x, oo.handle, cfg)
            return jnp.sum(yy.astype(jnp.float32))

        g = jax.grad(loss)(x)
        return o.num_recv_tokens[None], o8.num_recv_tokens[None], y, g

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    rng = np.random.default_rng(0)
    L = E // R
    for round_ in range(3):
        idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(R * T)]).astype(np.int32)
        idx[rng.random(idx.shape) < 0.2] = -1
        x = np.asarray(rng.normal(size=(R * T, H))).astype(jnp.bfloat16)
        w = rng.random(size=idx.shape).astype(np.float32)
        n, n8, y, g = (np.asarray(v) for v in multihost_utils.process_allgather(
            f(*(_global(v, mesh) for v in (x, idx, w))), tiled=True))
        owner = np.where(idx >= 0, idx // L, -1)
        expect = [int((owner == r).any(-1).sum()) for r in range(R)]  # tokens each rank receives
        assert n.tolist() == expect and n8.tolist() == expect, (n, n8, expect)
        # combine of the unchanged rows: x times the number of ranks that kept the token
        kept = np.array([len({int(o) for o in row if o >= 0}) for row in owner], dtype=np.float32)
        np.testing.assert_allclose(y.astype(np.float32), x.astype(np.float32) * kept[:, None], rtol=2 ** -7,
                                   atol=2 ** -7)
        np.testing.assert_allclose(g.astype(np.float32), np.repeat(kept[:, None], H, 1), rtol=2 ** -7)
        print(f"round {round_}: num_recv_tokens {expect}")
    jax_ep.finalize()
    print("normal_nvshmem_small: OK")


if __name__ == "__main__":
    from jax_ep.launch import init_from_env

    init_from_env()
    main()
