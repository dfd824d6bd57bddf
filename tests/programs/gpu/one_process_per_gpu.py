"""GPU child program for tests/gpu/test_multiprocess_cuda.py: the CUDA backend through jax_ep.initialize, either
one process per GPU (`python -m jax_ep.launch -n N one_process_per_gpu.py ...`) or one process driving N GPUs (run
directly).

Checks, on every process:
  - the runtime (process model, transport, teams: membership and sizes against the (R, num_max_nvl_peers) rule);
  - normal-mode dispatch (bf16 and fp8) bit-identical to backend="reference" in the same processes, combine within
    f32-accumulation tolerance, gradients through dispatch + combine close to the reference;
  - finalize, then initialize again, then the same program gives the same outputs;
  - --mismatch: after a good initialize/finalize, process 1 asks for another hidden size: every process gets an
    EPError naming configs[*].hidden (before any NVSHMEM collective), then a matching initialize works again.
Process 0 writes every gathered output to --out (.npz) so the test can compare the two process models bit for bit.
Prints `RESULT <what> ...` lines; any failed check raises (non-zero exit).
"""
import argparse
import dataclasses
import json
import os
import re
import sys
import time

from _child import prepare, reporter

prepare()

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
ap.add_argument("--ranks", type=int, default=None, help="GPUs in the mesh (default: all)")
ap.add_argument("--dp", type=int, default=1, help="mesh (dp, ep): several EP groups")
ap.add_argument("--nvl", type=int, default=8, help="EPConfig.num_max_nvl_peers")
ap.add_argument("--mismatch", action="store_true")
ap.add_argument("--teams-only", action="store_true", help="initialize, check the teams, finalize; no ops")
ap.add_argument("--no-finalize", action="store_true", help="leave the teardown to jax_ep's exit hook")
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--ll-over-nvshmem", action="store_true",
                help="EPConfig(allow_nvlink_for_low_latency=False): LL rows by NVSHMEM puts "
                     "(nvshmem/device/low_latency.cu)")
a = ap.parse_args()

from jax_ep.launch import init_from_env  # noqa: E402

pid, nproc = init_from_env()

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
import jax_ep._native  # noqa: E402


result = reporter(pid)


devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[: a.ranks or len(jax.devices())]
G = len(devices)
R = G // a.dp
mesh = Mesh(np.array(devices).reshape(a.dp, R), ("dp", "ep")) if a.dp > 1 else Mesh(np.array(devices), ("ep",))
axes = tuple(mesh.axis_names)
E, K, T, H = 8 * R, 4, a.tokens, a.hidden


def configs(hidden=H):
    """Per backend, the config of every op (low-latency ops per_expert, the mode of the NVSHMEM kernels, so y_ll means
    the same op in every process model); where the low-latency ops run the NVLink kernels (R <= num_max_nvl_peers,
    NVLink allowed) also a per_rank config ("<backend> per_rank": low_latency_mode="per_rank" has no NVSHMEM
    kernels)."""
    out = {}
    for b in ("cuda", "reference"):
        out[b] = jax_ep.EPConfig(E, hidden, K, T, backend=b, num_max_nvl_peers=a.nvl, timeout_seconds=30.0,
                                 allow_nvlink_for_low_latency=not a.ll_over_nvshmem, low_latency_mode="per_expert")
        if not a.ll_over_nvshmem and R <= a.nvl:
            out[f"{b} per_rank"] = dataclasses.replace(out[b], low_latency_mode="per_rank")
    return out


cfgs = configs()
t0 = time.perf_counter()
rt = jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=not a.teams_only)  # --teams-only: no ops at all
init_s = time.perf_counter() - t0
# one process per GPU: several processes, or one with JAX_EP_TRANSPORT=nvshmem (the same NVSHMEM path on one GPU)
per_gpu = nproc > 1 or os.environ.get("JAX_EP_TRANSPORT", "").strip().lower() == "nvshmem"
want_model = "multi-process" if per_gpu else "single-process"
assert rt.process_model == want_model and rt.backends[cfgs["cuda"]] == "cuda", rt
assert rt.transport == ("nvshmem" if per_gpu else "cuda-peer"), rt.transport
result("runtime", model=rt.process_model, transport=rt.transport, seconds=f"{init_s:.3f}",
       timings=json.dumps({k: round(v * 1e3, 2) for k, v in rt.timings.items()}))
if per_gpu:  # receive pools per axis: "on" / "off: why" (direct receive across processes)
    result("receive_pools", pools=json.dumps(rt.transport_state.summary()["receive_pools"]))

# ---- the NVSHMEM device-API check of initialize: every PE's counted messages arrived intact ----
if per_gpu:
    dc = rt.transport_state.summary()["device_check"]
    if dc is not None:
        assert dc["my_pe"] == jax.process_index() and dc["n_pes"] == nproc == dc["complete"], dc
        assert dc["bad_counts"] == dc["bad_payloads"] == 0 and dc["first_missing"] == -1, dc
    result("device_check", ran=dc is not None, **(dc or {}))

# ---- teams: membership and sizes (one process per GPU) ----
if per_gpu:
    me = jax.process_index()
    mine = [t for t in rt.teams if t["member"]]
    group_teams = [t for t in rt.teams if t["kind"] == "group"]
    assert len(group_teams) == a.dp, rt.teams
    my_group = [t for t in mine if t["kind"] == "group"]
    assert len(my_group) == 1 and my_group[0]["size"] == R and my_group[0]["n_pes"] == R, mine
    r = my_group[0]["pes"].index(me)
    assert my_group[0]["my_rank"] == r
    subs = [t for t in mine if t["kind"] == "nvl"]
    if R > a.nvl:
        assert len(subs) == 1, subs
        s = subs[0]
        want_ranks = [q for q in range(R) if q % a.nvl == r % a.nvl]
        assert s["ranks"] == want_ranks and s["size"] == len(want_ranks) == s["n_pes"], s
        assert s["pes"] == [my_group[0]["pes"][q] for q in want_ranks] and s["my_rank"] == want_ranks.index(r), s
    else:
        assert not subs, subs
    n_sub = sum(t["kind"] == "nvl" for t in rt.teams)
    assert n_sub == (a.dp * a.nvl if R > a.nvl else 0), rt.teams
    nodes = [t for t in mine if t["kind"] == "node"]
    if R > a.nvl > 1:  # the NVLink team: the ranks of this rank's node
        want_ranks = [q for q in range(R) if q // a.nvl == r // a.nvl]
        assert len(nodes) == 1 and nodes[0]["ranks"] == want_ranks and nodes[0]["n_pes"] == len(want_ranks), nodes
        assert nodes[0]["my_rank"] == want_ranks.index(r), nodes
        assert nodes[0]["pes"] == [my_group[0]["pes"][q] for q in want_ranks], nodes
    else:
        assert not nodes, nodes
    result("teams", rank=r, group=my_group[0]["pes"], nvl_team=subs[0]["pes"] if subs else None,
           total=len(rt.teams), sizes=[t["size"] for t in rt.teams])
if a.teams_only:
    if not a.no_finalize:
        jax_ep.finalize()
    result("done", ok=True)
    sys.exit(0)

# ---- inputs: value-encoded rows (global rank, token) + DeepEP routing, the same in both process models ----
rng = np.random.default_rng(2024)
x = rng.normal(size=(G, T, H)).astype(np.float32)
x[:, :, 0] = np.arange(G)[:, None] + 1
x[:, :, 1] = np.arange(T)[None, :] + 1
scores = np.abs(rng.normal(size=(G, T, E))) + 1
idx = np.argsort(-scores, axis=-1)[..., :K].astype(np.int32)
idx[rng.random(idx.shape) < 0.1] = -1
w = rng.random(size=idx.shape).astype(np.float32)
scale = rng.normal(size=(G, R * T, 1)).astype(np.float32)
cot = rng.normal(size=(G, T, H)).astype(np.float32)
spec = P(axes)
sharding = NamedSharding(mesh, spec)
mine_rows = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]


def put(v, dtype=None):
    v = np.asarray(v).reshape((G * v.shape[1],) + v.shape[2:])
    v = v if dtype is None else v.astype(dtype)
    rows = v.shape[0] // G
    local = np.concatenate([v[i * rows:(i + 1) * rows] for i in mine_rows])
    return jax.make_array_from_process_local_data(sharding, local, v.shape)


xs = put(x, jnp.bfloat16)
q = (x / 8).astype(jnp.float8_e4m3fn)
q_scales = np.abs(rng.normal(size=(G, T, H // 128))).astype(np.float32) + 0.5
args = (xs, put(idx), put(w), put(q), put(q_scales), put(scale), put(cot))


def program(cfg, cfg_per_rank=None):
    def body(x, idx, w, q, qs, scale, cot):
        out = jax_ep.dispatch(x, idx, w, cfg)
        y, yw = jax_ep.combine(out.recv_x, out.handle, cfg, out.recv_topk_weights)
        o8 = jax_ep.dispatch(q, idx, w, cfg, x_scales=qs)

        def loss(x, w):
            o = jax_ep.dispatch(x, idx, w, cfg)
            yy, yyw = jax_ep.combine((o.recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16), o.handle, cfg,
                                     o.recv_topk_weights * scale)
            return jnp.sum(yy.astype(jnp.float32) * cot) + jnp.sum(yyw)

        gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
        # low-latency mode; rows >= recv_count are unspecified (SPEC §4), so they are zeroed before comparing
        ll8 = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        ll16 = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)

        def valid_rows(v, count):
            ok = jnp.arange(v.shape[1])[None, :] < count[:, None]
            return jnp.where(ok.reshape(ok.shape + (1,) * (v.ndim - 2)), v, jnp.zeros((), v.dtype))

        ll_rows = valid_rows(ll16.recv_x, ll16.recv_count)
        y_ll = jax_ep.low_latency_combine(ll_rows, idx, w, ll16.handle, cfg)
        res = dict(recv_x=out.recv_x, recv_topk_idx=out.recv_topk_idx, recv_topk_weights=out.recv_topk_weights,
                   num_recv_tokens=out.num_recv_tokens[None], num_recv_tokens_per_expert=out.num_recv_tokens_per_expert,
                   y=y, yw=yw, fp8_recv_x=o8.recv_x, fp8_recv_x_scales=o8.recv_x_scales, fp8_num=o8.num_recv_tokens[None],
                   grad_x=gx, grad_w=gw, **{f"handle_{k}": v for k, v in out.handle._asdict().items()},
                   ll_recv_x=ll_rows, ll_recv_count=ll16.recv_count, ll_src_info=ll16.handle.src_info,
                   ll_layout_range=ll16.handle.layout_range, ll_fp8_recv_count=ll8.recv_count,
                   ll_fp8_scales=valid_rows(ll8.recv_x_scales, ll8.recv_count),
                   llfp8_x=valid_rows(ll8.recv_x, ll8.recv_count), y_ll=y_ll)
        if cfg_per_rank is not None:  # per_rank mode: the same rows as per_expert, plus its message tables
            pr = jax_ep.low_latency_dispatch(x, idx, cfg_per_rank, use_fp8=False)
            pr_rows = valid_rows(pr.recv_x, pr.recv_count)
            res.update(ll_pr_recv_x=pr_rows, ll_pr_recv_count=pr.recv_count, ll_pr_src_info=pr.handle.src_info,
                       ll_pr_msg_token=pr.handle.msg_token, ll_pr_token_rows=pr.handle.token_rows,
                       y_ll_pr=jax_ep.low_latency_combine(pr_rows, idx, w, pr.handle, cfg_per_rank))
        return res

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 7, out_specs=spec))


def cuda_program():
    """The CUDA backend's program, with the per_rank ops where that config exists."""
    return program(cfgs["cuda"], cfgs.get("cuda per_rank"))


def host(res):
    g = multihost_utils.process_allgather(res, tiled=True)
    return {k: np.asarray(v) for k, v in g.items()}


def bits(v):
    return v.view(np.uint16) if v.dtype == jnp.bfloat16 else (v.view(np.uint8) if v.dtype == jnp.float8_e4m3fn else v)


def call_attrs(hlo, target, name):
    """The values of i32 attribute `name` over the lowered custom calls whose target matches `target`."""
    return sorted({int(v) for line in hlo.splitlines() if re.search(target, line)
                   for v in re.findall(rf"\b{name} = (\d+) : i32", line)})


# which kernels the lowered program calls (nvshmem = 1: the NVSHMEM kernels; EPConfig.low_latency_over_nvshmem for the
# LL targets, EPConfig.normal_over_nvshmem for dispatch / cached dispatch / combine)
hlo = program(cfgs["cuda"]).trace(*args).lower().as_text()
LL_TARGETS, NORMAL_TARGETS = r"@jax_ep_low_latency_", r"@jax_ep_(dispatch|cached_dispatch|combine)_v"
result("ll_kernels", nvshmem=call_attrs(hlo, LL_TARGETS, "nvshmem"),
       nvl_domain=call_attrs(hlo, LL_TARGETS, "nvl_domain"))
result("normal_kernels", nvshmem=call_attrs(hlo, NORMAL_TARGETS, "nvshmem"))
got = host(cuda_program()(*args))
want = host(program(cfgs["reference"], cfgs.get("reference per_rank"))(*args))
exact = [k for k in got if not k.startswith(("y", "grad", "llfp8"))]
for k in exact:
    np.testing.assert_array_equal(bits(got[k]), bits(want[k]), err_msg=f"{k}: cuda != reference")
np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=1e-2, atol=1e-2)
np.testing.assert_allclose(got["yw"], want["yw"], rtol=1e-5, atol=1e-6)
# fp8 quantized in the kernel: within one e4m3 step of XLA's conversion (same sign, |code difference| <= 1)
ca, cb = got["llfp8_x"].view(np.uint8).astype(int), want["llfp8_x"].view(np.uint8).astype(int)
assert (((ca ^ cb) & 0x80 == 0) & (np.abs((ca & 0x7F) - (cb & 0x7F)) <= 1) | ((ca | cb) & 0x7F == 0)).all()
for k in ("y_ll", "y_ll_pr") if "y_ll_pr" in got else ("y_ll",):
    y_ll_err = np.max(np.abs(got[k].astype(np.float64) - want[k].astype(np.float64)))
    assert y_ll_err <= 2 ** -7 * max(1.0, np.max(np.abs(want[k].astype(np.float64)))), (k, y_ll_err)
if "ll_pr_recv_x" in got:  # per_rank moves the same rows as per_expert
    for k in ("recv_x", "recv_count", "src_info"):
        np.testing.assert_array_equal(bits(got[f"ll_pr_{k}"]), bits(got[f"ll_{k}"]), err_msg=f"per_rank {k}")
for k in ("grad_x", "grad_w"):
    ga, gb = got[k].astype(np.float64), want[k].astype(np.float64)
    rel = np.linalg.norm(ga - gb) / np.linalg.norm(gb)
    assert np.isfinite(ga).all() and rel < 1e-2, f"{k}: relative error {rel:.2e}"
assert int(got["num_recv_tokens"].sum()) > 0
result("correctness", exact=len(exact), rows=int(got["num_recv_tokens"].sum()),
       y_checksum=float(got["y"].astype(np.float64).sum()),
       direct_calls=jax_ep._native.module().direct_buffer_calls())

# ---- finalize, initialize again, same outputs ----
jax_ep.finalize()
assert jax_ep.runtime.current() is None
rt2 = jax_ep.initialize(mesh, *cfgs.values())
if per_gpu:
    assert rt2.timings["bootstrap"] == 0.0, rt2.timings  # NVSHMEM stayed up; teams and buffers are new
again = host(cuda_program()(*args))
for k in got:
    np.testing.assert_array_equal(bits(again[k]), bits(got[k]), err_msg=f"{k} after finalize + initialize")
result("reinitialize", ok=True, timings=json.dumps({k: round(v * 1e3, 2) for k, v in rt2.timings.items()}))

# ---- a mismatch between processes is an error naming it, not a hang ----
if a.mismatch and nproc > 1:
    jax_ep.finalize()
    bad = configs(hidden=H + 128 if jax.process_index() == 1 else H)
    t = time.perf_counter()
    try:
        jax_ep.initialize(mesh, *bad.values())
        raise AssertionError("a mismatched initialize succeeded")
    except jax_ep.EPError as e:
        msg = str(e)
        assert "disagree on the setup" in msg and ".hidden" in msg, msg
        result("mismatch", seconds=f"{time.perf_counter() - t:.2f}", error=msg.replace(chr(10), " ")[:300])
    jax_ep.initialize(mesh, *cfgs.values())
    again = host(cuda_program()(*args))
    np.testing.assert_array_equal(bits(again["recv_x"]), bits(got["recv_x"]))
    result("after_mismatch", ok=True)

if a.out and jax.process_index() == 0:
    np.savez(a.out, **{k: bits(v) for k, v in got.items()})
    result("wrote", path=a.out, arrays=len(got))
jax_ep.finalize()
result("done", ok=True)
