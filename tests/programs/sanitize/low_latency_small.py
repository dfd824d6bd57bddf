"""A small low-latency run for compute-sanitizer (memcheck / racecheck): R = every GPU (1, 2, 4 or 8),
T=16, H=256, K=4, E=8; fp8 and bf16 dispatch (also of one token: per_expert runs that as one kernel), combine,
the split phases and a chain threading a LowLatencyState, three rounds with new routing, on the CUDA backend via
jax_ep.initialize. Checks recv_count against NumPy and prints 'low_latency_small: OK' at the end.

    compute-sanitizer --tool memcheck --kernel-name kns=low_latency_ \
        python3 tests/programs/sanitize/low_latency_small.py [per_rank]

Mode "nvshmem": per_expert with allow_nvlink_for_low_latency=False (the NVSHMEM kernels, names nvshmem_*), run in one
process per GPU; with -n 2 the other rank is reached by NVSHMEM puts, with -n 1 set JAX_EP_TEST_ALL_PEERS_REMOTE=1
for the remote path:
    JAX_EP_TRANSPORT=nvshmem compute-sanitizer --tool memcheck --kernel-name kns=nvshmem_ \
        python3 -m jax_ep.launch -n 1 tests/programs/sanitize/low_latency_small.py nvshmem
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
    """The host array v sharded along "ep" over the mesh (each process fills its own devices' rows)."""
    return jax.make_array_from_callback(v.shape, NamedSharding(mesh, P("ep")), lambda index: v[index])


def main(mode: str = "per_expert"):
    T, H, K, E = 16, 256, 4, 8
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    R = max([r for r in (1, 2, 4, 8) if r <= len(gpus)], default=0)  # a divisor of E: every GPU of launch -n 4 too
    if R < 1:
        print("low_latency_small skipped: needs a CUDA GPU, found none")
        return
    mesh = Mesh(np.array(gpus[:R]), ("ep",))
    over_nvshmem = mode == "nvshmem"
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda", timeout_seconds=60.0,
                          low_latency_mode="per_expert" if over_nvshmem else mode,
                          allow_nvlink_for_low_latency=not over_nvshmem)
    jax_ep.initialize(mesh, cfg)

    def body(x, idx, w):
        # one LowLatencyState through every LL op: the program order the CUDA backend needs (docs/API.md)
        st = jax_ep.low_latency_state(cfg)
        a, st = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True, state=st)
        pb, st = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=st)
        b, st = jax_ep.low_latency_dispatch_recv(pb, cfg, state=st)
        y, st = jax_ep.low_latency_combine(b.recv_x, idx, w, b.handle, cfg, state=st)
        pc, st = jax_ep.low_latency_combine_send(b.recv_x, idx, w, b.handle, cfg, state=st)
        y2, st = jax_ep.low_latency_combine_recv(pc, cfg, state=st)
        p, st = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=st)
        c, st = jax_ep.low_latency_dispatch_recv(p, cfg, state=st)
        y3, st = jax_ep.low_latency_combine(c.recv_x, idx, w, c.handle, cfg, state=st)
        one, st = jax_ep.low_latency_dispatch(x[:1], idx[:1], cfg, use_fp8=True, state=st)
        return a.recv_count, b.recv_count, one.recv_count, y, y2, y3, st.value

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    rng = np.random.default_rng(0)
    for round_ in range(3):
        idx = np.stack([rng.choice(E, size=K, replace=False) for _ in range(R * T)]).astype(np.int32)
        idx[rng.random(idx.shape) < 0.2] = -1
        x = np.asarray(rng.normal(size=(R * T, H))).astype(jnp.bfloat16)
        w = rng.random(size=idx.shape).astype(np.float32)
        # global arrays and gathered results: the same code in one process and in one process per GPU
        outs = f(*(_global(v, mesh) for v in (x, idx, w)))
        c8, c16, c1, y, y2, y3, st = (np.asarray(v) for v in multihost_utils.process_allgather(outs, tiled=True))
        jax_ep.check_low_latency_state(st)
        assert (np.asarray(st).reshape(-1, 4) == [7, 0, 0, 0]).all(), st
        assert np.array_equal(np.asarray(y).view(np.uint16), np.asarray(y3).view(np.uint16))
        expect = [int((idx == e).sum()) for e in range(E)]  # rows per expert (no repeats in this routing)
        assert c8.tolist() == expect and c16.tolist() == expect, (c8, c16, expect)
        first = idx[::T]  # each rank's first token
        expect1 = [int((first == e).sum()) for e in range(E)]
        assert c1.tolist() == expect1, (c1, expect1)
        assert np.array_equal(np.asarray(y).view(np.uint16), np.asarray(y2).view(np.uint16))
        print(f"round {round_}: recv_count {expect}")
    jax_ep.finalize()
    print(f"low_latency_small ({mode}): OK")


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:2])
