"""GPU child program for tests/gpu/test_multiprocess_cuda.py: an EP group that spans simulated hosts.

Run as `JAX_EP_TEST_RANKS_PER_HOST=k python -m jax_ep.launch -n N low_latency_across_hosts.py --nvl k`: ranks r, q with
r // k != q // k get no load/store pointer to each other's buffers (runtime/nvshmem.py), as across real hosts, so
the group can only work through NVSHMEM puts. Checks, on every process:
  - initialize succeeds and reports the unmapped ranks (transport summary "unmapped");
  - this rank's NVSHMEM teams: the group, its RDMA team (same NVLink-local index) and NVLink team (its node);
  - --steps low-latency steps in one jitted scan, new routing every step (-1s included): fp8 and bf16 dispatch
    bit-identical to backend="reference" (valid rows), recv counts equal, combine within bf16 tolerance;
  - with JAX_EP_TEST_COUNT_REMOTE_BYTES=1: the bytes this rank put across the host boundary are exactly one
    dispatch message per (own token, expert on another host) and one combine row per (token from another host,
    own expert), from a device counter in the NVSHMEM kernels;
  - --steps normal-mode steps on the same axis (dispatch + combine, new routing every step) bit-identical to the
    reference backend (combine within f32-accumulation tolerance), a gradient through both (cached dispatch), and
    with the byte counter exactly one copy per (own token, destination rank on another host) put by dispatch and one
    row per (row received from another host) put back by combine; then the low-latency program runs again.
Every check compares this process's shard of the outputs (no collective gathers them). --oracle cpu runs the
reference backend on a mesh of the processes' CPU devices (gloo collectives) instead of the GPUs: for several
processes per GPU (`jax_ep.launch --processes-per-gpu`), where NCCL, and so XLA's GPU collectives, refuse to run.
Prints `RESULT <what> ...` lines; any failed check raises (non-zero exit).
"""
import argparse
import os

from _child import prepare, reporter

prepare()

ap = argparse.ArgumentParser()
ap.add_argument("--nvl", type=int, default=1, help="EPConfig.num_max_nvl_peers (= JAX_EP_TEST_RANKS_PER_HOST)")
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--tokens", type=int, default=32)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--oracle", choices=("gpu", "cpu"), default="gpu",
                help="where the reference backend runs: the GPU mesh (NCCL) or the processes' CPU devices (gloo)")
a = ap.parse_args()

from jax_ep.launch import init_from_env  # noqa: E402

if a.oracle == "cpu":
    import jax  # noqa: E402

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before any backend exists
pid, nproc = init_from_env()

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402


result = reporter(pid)


devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
R = len(devices)
mesh = Mesh(np.array(devices), ("ep",))
E, K, T, H, S = 4 * R, 4, a.tokens, a.hidden, a.steps
cfgs = {b: jax_ep.EPConfig(E, H, K, T, backend=b, num_max_nvl_peers=a.nvl, timeout_seconds=30.0)
        for b in ("cuda", "reference")}
rt = jax_ep.initialize(mesh, *cfgs.values())
if a.oracle == "cpu":
    cpus = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    assert [d.process_index for d in cpus] == [d.process_index for d in devices], (cpus, devices)
    oracle_mesh = Mesh(np.array(cpus), ("ep",))
else:
    oracle_mesh = mesh
me = jax.process_index()
unmapped = rt.transport_state.summary()["unmapped"]["ep"]
want = [q for q in range(R) if q // a.nvl != me // a.nvl]
assert unmapped == want, (unmapped, want)
assert cfgs["cuda"].low_latency_over_nvshmem(R), "the group spans hosts: the NVSHMEM kernels must run"
result("unmapped", ranks=unmapped)

# ---- teams (issue 14, item 1): the group, this rank's RDMA team (its NVLink-local index on every node) and its
# NVLink team (its node), with n_pes / my_rank as NVSHMEM reports them (nvshmem_team_n_pes / nvshmem_team_my_pe)
member = [t for t in rt.teams if t["member"]]
mine = {t["kind"]: t for t in member}
assert sorted(t["kind"] for t in member) == sorted(mine), member  # one team of each kind
rdma_ranks = [q for q in range(R) if q % a.nvl == me % a.nvl]
node_ranks = [q for q in range(R) if q // a.nvl == me // a.nvl]
assert (mine["group"]["n_pes"], mine["group"]["my_rank"]) == (R, me), mine["group"]
for kind, ranks in (("nvl", rdma_ranks), ("node", node_ranks)):
    if kind == "node" and a.nvl == 1:
        assert kind not in mine, mine  # nodes of one rank: no NVLink team
        continue
    t = mine[kind]
    assert t["ranks"] == ranks and (t["n_pes"], t["my_rank"]) == (len(ranks), ranks.index(me)), t
result("teams", rdma=rdma_ranks, nvlink=node_ranks if a.nvl > 1 else None, total=len(rt.teams))

# ---- inputs: [S steps] x (R ranks x T tokens); value-encoded rows, new routing every step ----
rng = np.random.default_rng(7)
x = rng.normal(size=(S, R * T, H)).astype(np.float32)
x[:, :, 0] = np.arange(R * T)[None, :] + 1  # global token id
x[:, :, 1] = np.arange(S)[:, None] + 1      # step
scores = np.abs(rng.normal(size=(S, R * T, E))) + 1
idx = np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)
idx[rng.random(idx.shape) < 0.1] = -1
w = rng.random(size=idx.shape).astype(np.float32)
spec = P(None, "ep")


def put(v, dtype=None, on=mesh):
    v = np.asarray(v) if dtype is None else np.asarray(v).astype(dtype)
    return jax.make_array_from_callback(v.shape, NamedSharding(on, spec), lambda index: v[index])


args = (put(x, jnp.bfloat16), put(idx), put(w))
oracle_args = (put(x, jnp.bfloat16, oracle_mesh), put(idx, on=oracle_mesh), put(w, on=oracle_mesh))


def inputs(cfg):
    """The program's mesh and arguments: the reference backend runs where --oracle says."""
    return (oracle_mesh, oracle_args) if cfg.backend == "reference" else (mesh, args)


def program(cfg):
    def step(_, xs):
        x, idx, w = xs
        o8 = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        o16 = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        ok = (jnp.arange(o16.recv_x.shape[1])[None, :] < o16.recv_count[:, None])[..., None]
        rows = jnp.where(ok, o16.recv_x, jnp.zeros((), o16.recv_x.dtype))
        y = jax_ep.low_latency_combine(rows, idx, w, o16.handle, cfg)
        ok8 = (jnp.arange(o8.recv_x.shape[1])[None, :] < o8.recv_count[:, None])[..., None]
        return None, dict(rows=rows, count=o16.recv_count[None], count8=o8.recv_count[None],
                          fp8=jnp.where(ok8, o8.recv_x.astype(jnp.float32), 0.0)[None], y=y)

    def body(x, idx, w):
        return jax.lax.scan(step, None, (x, idx, w))[1]

    on, xs = inputs(cfg)
    return jax.jit(jax.shard_map(body, mesh=on, in_specs=(spec,) * 3, out_specs=P(None, "ep")))(*xs)


def host(res):
    """This process's shard of every output (one addressable shard: one device per process)."""
    return {k: np.asarray(v.addressable_shards[0].data) for k, v in res.items()}


from jax_ep.runtime import nvshmem as nvshmem_runtime  # noqa: E402

counting = os.environ.get("JAX_EP_TEST_COUNT_REMOTE_BYTES") == "1"
nvshmem_runtime.module().test_remote_put_bytes(reset=True)
got = host(program(cfgs["cuda"]))
put_bytes = nvshmem_runtime.module().test_remote_put_bytes(reset=True)
ref = host(program(cfgs["reference"]))
for k in ("rows", "count", "count8"):
    np.testing.assert_array_equal(got[k].view(np.uint16) if got[k].dtype == jnp.bfloat16 else got[k],
                                  ref[k].view(np.uint16) if ref[k].dtype == jnp.bfloat16 else ref[k],
                                  err_msg=f"{k}: cuda != reference across simulated hosts")
# fp8 quantized in the kernel: within one e4m3 step of XLA's conversion, compared as dequantized-free codes
np.testing.assert_allclose(got["fp8"], ref["fp8"], rtol=2 ** -3, atol=2 ** -9)
err = np.max(np.abs(got["y"].astype(np.float64) - ref["y"].astype(np.float64)))
assert err <= 2 ** -7 * max(1.0, np.max(np.abs(ref["y"].astype(np.float64)))), err
assert int(got["count"].sum()) > 0
result("low_latency", steps=S, rows=int(got["count"].sum()), y_err=f"{err:.3g}")

# ---- the traffic that crossed the (simulated) host boundary: one message per (token, expert on another host) --
# Each dispatch message is a 16-byte header (kLowLatencyMsgHeader, cuda/include/jax_ep/constants.h) + the payload
# (fp8: H codes + one f32 scale per 128 channels; bf16: 2H); the combine sends one bf16 row per (token of a rank on
# another host, expert of this rank) back. Nothing to a rank of this host and no signal words are counted.
# routing facts both byte checks use
host_of = np.arange(R) // a.nvl                                  # simulated host of each rank
mine = slice(me * T, (me + 1) * T)                               # this rank's tokens
owner = np.where(idx >= 0, idx // (E // R), -1)                  # [S, R*T, K] owner rank of each (token, expert)
token_rank = np.repeat(np.arange(R), T)                          # [R*T] rank of each token
if counting:
    out_pairs = int(((owner[:, mine] >= 0) & (host_of[np.maximum(owner[:, mine], 0)] != host_of[me])).sum())
    back_pairs = int(((owner == me) & (host_of[token_rank] != host_of[me])[None, :, None]).sum())
    want_bytes = out_pairs * ((16 + H + 4 * (H // 128)) + (16 + 2 * H)) + back_pairs * 2 * H
    assert put_bytes == want_bytes, (put_bytes, want_bytes, out_pairs, back_pairs)
    assert out_pairs > 0 and back_pairs > 0
    result("remote_bytes", bytes=put_bytes, dispatch_pairs=out_pairs, combine_rows=back_pairs)

# ---- normal mode on the same axis (nvshmem/device/normal_send.cu): every row to the other host by NVSHMEM puts ----
def normal_program(cfg):
    def step(_, xs):
        x, idx, w = xs
        o = jax_ep.dispatch(x, idx, w, cfg)
        ok = (jnp.arange(o.recv_x.shape[0]) < o.num_recv_tokens)[:, None]
        rows = jnp.where(ok, o.recv_x, jnp.zeros((), o.recv_x.dtype))
        y, yw = jax_ep.combine(rows, o.handle, cfg, o.recv_topk_weights)
        return None, dict(rows=rows, idx=jnp.where(ok, o.recv_topk_idx, -1), w=jnp.where(ok, o.recv_topk_weights, 0),
                          n=o.num_recv_tokens[None], per_expert=o.num_recv_tokens_per_expert[None], y=y, yw=yw)

    def body(x, idx, w):
        return jax.lax.scan(step, None, (x, idx, w))[1]

    on, xs = inputs(cfg)
    return jax.jit(jax.shard_map(body, mesh=on, in_specs=(spec,) * 3, out_specs=P(None, "ep")))(*xs)


def grad_program(cfg, dispatch_dtype=jnp.bfloat16):
    """d/dx of a loss through dispatch and combine: the combine's VJP is a cached dispatch, the dispatch's a combine
    of the cotangent in dispatch_dtype (float32: f32 values, nvshmem_combine_forward_kernel<float> when forwarding)."""
    def loss(x, idx, w):
        o = jax_ep.dispatch(x.astype(dispatch_dtype), idx, w, cfg)
        y, _ = jax_ep.combine((o.recv_x.astype(jnp.float32) * 1.5).astype(jnp.bfloat16), o.handle, cfg)
        return jnp.sum(y.astype(jnp.float32) * x.astype(jnp.float32))

    def body(x, idx, w):
        return jax.grad(loss)(x[0], idx[0], w[0])[None]

    on, xs = inputs(cfg)
    return jax.jit(jax.shard_map(body, mesh=on, in_specs=(spec,) * 3, out_specs=P(None, "ep")))(*xs)


assert cfgs["cuda"].normal_over_nvshmem(R), "the group spans hosts: the NVSHMEM normal-mode kernels must run"
nvshmem_runtime.module().test_remote_put_bytes(reset=True)
ngot = host(normal_program(cfgs["cuda"]))
normal_bytes = nvshmem_runtime.module().test_remote_put_bytes(reset=True)
nref = host(normal_program(cfgs["reference"]))
for k in ("rows", "idx", "w", "n", "per_expert"):
    np.testing.assert_array_equal(ngot[k].view(np.uint16) if ngot[k].dtype == jnp.bfloat16 else ngot[k],
                                  nref[k].view(np.uint16) if nref[k].dtype == jnp.bfloat16 else nref[k],
                                  err_msg=f"normal {k}: cuda != reference across simulated hosts")
for k in ("y", "yw"):
    ref_k = nref[k].astype(np.float64)
    nerr = np.max(np.abs(ngot[k].astype(np.float64) - ref_k))
    assert nerr <= 2 ** -7 * max(1.0, np.max(np.abs(ref_k))), (k, nerr)
for dispatch_dtype in (jnp.bfloat16, jnp.float32):  # f32: the combine of the dispatch's VJP moves f32 rows
    gx = host(dict(g=grad_program(cfgs["cuda"], dispatch_dtype)))["g"]
    gref = host(dict(g=grad_program(cfgs["reference"], dispatch_dtype)))["g"]
    gerr = np.max(np.abs(gx.astype(np.float64) - gref.astype(np.float64)))
    assert gerr <= 2 ** -6 * max(1.0, np.max(np.abs(gref.astype(np.float64)))), (jnp.dtype(dispatch_dtype).name, gerr)
assert int(ngot["n"].sum()) > 0
result("normal", steps=S, rows=int(ngot["n"].sum()), grad_err=f"{gerr:.3g}")

# Dispatch: with hosts of 2-8 ranks (hierarchical dispatch, staging_layout.h forward_nodes), one copy per (own token,
# destination host): the bf16 row and one forward record (tag, 8 destination rows, K global ids, K weights); with
# hosts of one rank, one copy per (own token, destination rank on another host): the bf16 row and one meta record
# (K local ids, K weights, the source index). Combine: one row per (received row from another host): the bf16 row
# and K weights.
if counting:
    dest = np.stack([(owner == d).any(-1) for d in range(R)], axis=-1)           # [S, R*T, R] token -> rank d
    remote_dest = dest[:, mine][..., host_of != host_of[me]]                      # own tokens to other hosts
    from_remote = dest[:, (host_of[token_rank] != host_of[me]), me]               # tokens of other hosts kept here
    forwarded = 2 <= a.nvl <= 8 and R % a.nvl == 0 and R // a.nvl >= 2
    if forwarded:
        # node-first combine: this rank forwards for the sources of its local index on other hosts, one partial
        # row (bf16: 2H) and K f32 weights per (such source, token) that a rank of this host kept
        hosts = R // a.nvl
        to_host = np.stack([dest[:, mine][..., host_of == h].any(-1) for h in range(hosts) if h != host_of[me]], -1)
        copies = int(to_host.sum())
        here = host_of == host_of[me]
        partials = sum(int(dest[:, s * T:(s + 1) * T][..., here].any(-1).sum())
                       for s in range(R) if s % a.nvl == me % a.nvl and not here[s])
        want_normal = copies * (2 * H + 4 * (1 + 8 + 2 * K)) + partials * (2 * H + 4 * K)
    else:
        copies = int(remote_dest.sum())
        want_normal = copies * (2 * H + 8 * K + 4) + int(from_remote.sum()) * (2 * H + 4 * K)
    assert normal_bytes == want_normal, (normal_bytes, want_normal, forwarded)
    result("normal_remote_bytes", bytes=normal_bytes, dispatch_copies=copies, per_host=forwarded,
           combine_rows=partials if forwarded else int(from_remote.sum()))
again = host(program(cfgs["cuda"]))
np.testing.assert_array_equal(again["count"], got["count"])
result("done", ok=True)
