"""Child program for tests/test_launch.py: jax_ep reference-backend dispatch/combine over a global mesh.

Runs the same program either as one of the processes of `python -m jax_ep.launch -n N` (each with
--local-devices CPU devices; the EP axis spans all processes' devices) or standalone as one process with all the
devices emulated. Inputs depend only on the global rank, so both runs must give the same outputs; process 0
gathers every output to the host and writes them to --out (.npz) for the test to compare.

Also value-checks on every process: combine(dispatch(x).recv_x) == x * (number of distinct ranks a token went
to), and the low-latency round trip with weights.
"""
import argparse

from _child import global_array, global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--local-devices", type=int, required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--tokens", type=int, default=6)
ap.add_argument("--hidden", type=int, default=16)
ap.add_argument("--experts-per-rank", type=int, default=2)
ap.add_argument("--topk", type=int, default=3)
ap.add_argument("--platform", default="cpu", help="cpu (default; emulated devices) or gpu (one per process)")
a = ap.parse_args()
pid, nproc = join_job(a.platform, a.local_devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

G = jax.device_count()
assert G == nproc * a.local_devices, (G, nproc, a.local_devices)
T, H, K = a.tokens, a.hidden, a.topk
E = G * a.experts_per_rank
L = a.experts_per_rank
devices = global_devices()
mesh = Mesh(np.array(devices), ("ep",))
cfg = jax_ep.EPConfig(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, backend="reference")
rt = jax_ep.initialize(mesh, cfg)
print(f"RESULT runtime process={pid} process_model={rt.process_model} transport={rt.transport}", flush=True)

# inputs for every rank (same on every process), value-encoded: row (g, t) = [g+1, t+1, small ints]
rng = np.random.default_rng(1234)
x = rng.integers(-8, 9, size=(G, T, H)).astype(np.float32)
x[:, :, 0] = np.arange(G)[:, None] + 1
x[:, :, 1] = np.arange(T)[None, :] + 1
scores = np.abs(rng.standard_normal((G, T, E))) + 1
idx = np.argsort(-scores, axis=-1, kind="stable")[..., :K].astype(np.int32)
idx[rng.random(idx.shape) < 0.15] = -1
w = rng.random((G, T, K)).astype(np.float32)

sh = NamedSharding(mesh, P("ep"))


def put(v, dtype=None):
    return global_array(sh, devices, np.asarray(v) if dtype is None else np.asarray(v).astype(dtype))


def body(x, idx, w):
    x, idx, w = x[0], idx[0], w[0]
    out = jax_ep.dispatch(x, idx, w, cfg)
    y, yw = jax_ep.combine(out.recv_x, out.handle, cfg, topk_weights=out.recv_topk_weights)
    ll = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
    y_ll = jax_ep.low_latency_combine(ll.recv_x, idx, w, ll.handle, cfg)

    def loss(xx):
        o = jax_ep.dispatch(xx, idx, w, cfg)
        yy, _ = jax_ep.combine(o.recv_x * 2, o.handle, cfg)
        return jnp.sum(yy.astype(jnp.float32) * jnp.arange(1, H + 1, dtype=jnp.float32))

    gx = jax.grad(loss)(x.astype(jnp.float32).astype(x.dtype))
    res = dict(recv_x=out.recv_x, recv_topk_idx=out.recv_topk_idx, recv_topk_weights=out.recv_topk_weights,
               num_recv_tokens=out.num_recv_tokens, num_recv_tokens_per_expert=out.num_recv_tokens_per_expert,
               y=y, yw=yw, ll_recv_x=ll.recv_x, ll_recv_count=ll.recv_count, y_ll=y_ll, grad_x=gx,
               **{f"handle_{k}": v for k, v in out.handle._asdict().items()})
    return jax.tree.map(lambda v: jnp.asarray(v)[None], res)


prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
res = prog(put(x, jnp.bfloat16), put(idx), put(w))
host = multihost_utils.process_allgather(res, tiled=True)
host = {k: np.asarray(v) for k, v in host.items()}

# value checks (every process, on the gathered global outputs)
ranks_hit = np.zeros((G, T), np.float32)
for g in range(G):
    for t in range(T):
        ranks_hit[g, t] = len({int(e) // L for e in idx[g, t] if e >= 0})
np.testing.assert_array_equal(host["y"].astype(np.float32), x * ranks_hit[..., None],
                              err_msg="combine(dispatch(x).recv_x) != x * distinct ranks")
wsum = np.where(idx >= 0, w, 0).sum(-1)
np.testing.assert_allclose(host["y_ll"].astype(np.float32), x * wsum[..., None], rtol=2 ** -7, atol=1e-2,
                           err_msg="low_latency_combine(low_latency_dispatch(x)) != x * sum(weights)")
want_g = 2 * ranks_hit[..., None] * np.arange(1, H + 1, dtype=np.float32)[None, None, :]
np.testing.assert_array_equal(host["grad_x"].astype(np.float32), want_g, err_msg="grad_x")
print(f"RESULT ep_roundtrip process={pid} ranks={G} rows_received={int(host['num_recv_tokens'].sum())} "
      f"y_checksum={float(host['y'].astype(np.float64).sum())}", flush=True)

if pid == 0:
    np.savez(a.out, **{k: (v.view(np.uint16) if v.dtype == jnp.bfloat16 else v) for k, v in host.items()})
    print(f"RESULT wrote {a.out} ({len(host)} arrays)", flush=True)
