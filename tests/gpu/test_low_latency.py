"""Low-latency mode on the CUDA backend (public ops through jax_ep.initialize) against backend="reference".

Oracle: the reference backend on the same GPUs (itself checked against the NumPy oracle in the CPU suite).
Dispatch: counts, layout_range, src_info and bf16 rows bit-identical; fp8 scales identical and fp8 codes within one
e4m3 step (XLA:GPU's f32 -> e4m3 conversion rounds some subnormals differently from the hardware cvt). Rows >=
recv_count are unspecified (SPEC §4) and not compared. Combine within f32-accumulation tolerance of bf16 outputs.

With JAX_EP_TEST_LL_OVER_NVSHMEM=1 every config sets allow_nvlink_for_low_latency=False, so the same tests run the
NVSHMEM put-with-signal kernels (nvshmem/device/ll_rdma.cu); tests/gpu/test_low_latency_nvshmem.py runs this file
that way under `python -m jax_ep.launch` with JAX_EP_TRANSPORT=nvshmem.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from intranode_harness import assert_grads_close, ll_round_trip_grads, rel_error as _rel, require as _require, upto as _upto

E, H, K, T_MAX = 32, 2048, 8, 128


def _mesh(ranks):
    return Mesh(np.array(jax.devices("gpu")[:ranks]), ("ep",))


OVER_NVSHMEM = os.environ.get("JAX_EP_TEST_LL_OVER_NVSHMEM") == "1"


def _cfgs(**kw):
    # a short device timeout: a kernel bug ends the run in seconds instead of hanging it
    return {b: jax_ep.EPConfig(kw.get("E", E), kw.get("H", H), K, kw.get("T_MAX", T_MAX), backend=b,
                               timeout_seconds=10.0, allow_nvlink_for_low_latency=not OVER_NVSHMEM)
            for b in ("cuda", "reference")}


@pytest.fixture(autouse=True)
def _finalize():
    yield
    rt = jax_ep.runtime.current()
    if OVER_NVSHMEM and rt is not None:  # the NVSHMEM kernels really ran: their transport, their table installed
        from jax_ep import _native

        assert rt.transport == "nvshmem" and _native.module().has_low_latency_rdma_ops(), rt.summary()
    jax_ep.finalize()


def _routing(rng, ranks, tokens, num_experts=E):
    scores = np.abs(rng.normal(size=(ranks * tokens, num_experts))) + 1
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.02] = num_experts + 3  # out of range: treated as -1
    idx[:, -1] = np.where(rng.random(len(idx)) < 0.05, idx[:, 0], idx[:, -1])  # a repeated expert
    return jnp.asarray(idx)


def _inputs(rng, ranks, tokens, hidden=H, num_experts=E):
    x = jnp.asarray(rng.normal(size=(ranks * tokens, hidden)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.random(size=(ranks * tokens, K)), jnp.float32)
    return x, _routing(rng, ranks, tokens, num_experts), w


def _dispatch_program(cfg, mesh, use_fp8):
    def body(x, idx):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=use_fp8)
        scales = out.recv_x_scales if use_fp8 else jnp.zeros((1,), jnp.float32)
        return out.recv_x, scales, out.recv_count, out.handle.src_info, out.handle.layout_range

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep")))


def _valid_rows(count, ranks, num_local, rows):
    """[R*L, rows] mask of rows < recv_count per (rank, local expert)."""
    return np.arange(rows)[None, :] < np.asarray(count).reshape(ranks * num_local, 1)


def _fp8_codes_close(a, b):
    """Same sign and |code difference| <= 1 (e4m3 codes are monotonic in magnitude within a sign)."""
    ca, cb = np.asarray(a).view(np.uint8).astype(np.int32), np.asarray(b).view(np.uint8).astype(np.int32)
    same_sign = (ca & 0x80) == (cb & 0x80)
    close = np.abs((ca & 0x7F) - (cb & 0x7F)) <= 1
    both_zero = ((ca & 0x7F) == 0) & ((cb & 0x7F) == 0)
    return (same_sign & close) | both_zero


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 64, 128])
@pytest.mark.parametrize("use_fp8", [True, False])
def test_dispatch_matches_reference(ranks, tokens, use_fp8):
    _check_dispatch(ranks, tokens, use_fp8, H)


# Shapes the default ones miss: fp8 rows whose scales are not a multiple of 16 bytes (H % 512 != 0), one segment
# (H=128), the decode shape (H=7168), token counts that are not a multiple of a warp.
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("hidden,tokens", [(128, 37), (384, 5), (7168, 33)])
@pytest.mark.parametrize("use_fp8", [True, False])
def test_dispatch_matches_reference_shapes(ranks, hidden, tokens, use_fp8):
    _check_dispatch(ranks, tokens, use_fp8, hidden)


def _check_dispatch(ranks, tokens, use_fp8, hidden):
    _require(ranks)
    mesh = _mesh(ranks)
    cfgs = _cfgs(H=hidden)
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)  # a runtime per test: no warm-up programs (suite time)
    x, idx, _ = _inputs(np.random.default_rng(ranks * 1000 + tokens + hidden), ranks, tokens, hidden=hidden)
    got = jax.device_get(_dispatch_program(cfgs["cuda"], mesh, use_fp8)(x, idx))
    want = jax.device_get(_dispatch_program(cfgs["reference"], mesh, use_fp8)(x, idx))
    for name, i in (("recv_count", 2), ("src_info", 3), ("layout_range", 4)):
        np.testing.assert_array_equal(got[i], want[i], err_msg=name)
    num_local, rows = E // ranks, ranks * T_MAX
    valid = _valid_rows(want[2], ranks, num_local, rows)
    assert valid.sum() > 0
    H_ = hidden
    g_x, w_x = got[0].reshape(ranks * num_local, rows, H_)[valid], want[0].reshape(ranks * num_local, rows, H_)[valid]
    if use_fp8:
        S = H_ // 128
        np.testing.assert_array_equal(got[1].reshape(-1, rows, S)[valid], want[1].reshape(-1, rows, S)[valid],
                                      err_msg="recv_x_scales")
        ok = _fp8_codes_close(g_x, w_x)
        assert ok.all(), f"{(~ok).sum()} fp8 values more than one e4m3 step from the reference"
        exact = np.mean(np.asarray(g_x).view(np.uint8) == np.asarray(w_x).view(np.uint8))
        print(f"fp8 codes identical to XLA's: {exact:.6f}")
    else:
        np.testing.assert_array_equal(np.asarray(g_x).view(np.uint16), np.asarray(w_x).view(np.uint16),
                                      err_msg="recv_x")


def _round_trip_program(cfg, mesh, split):
    """dispatch (bf16) -> per-expert transform -> combine; returns y and the dispatch handle."""
    def body(x, idx, w):
        if split:
            out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False), cfg)
        else:
            out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        scale = (1.0 + 0.25 * jnp.arange(out.recv_x.shape[0], dtype=jnp.float32))[:, None, None]
        expert_out = (out.recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        if split:
            pending = jax_ep.low_latency_combine_send(expert_out, idx, w, out.handle, cfg)
            y = jax_ep.low_latency_combine_recv(pending, cfg)
        else:
            y = jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)
        return y, out.handle.src_info

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 64, 128])
@pytest.mark.parametrize("split", [False, True])
def test_combine_matches_reference(ranks, tokens, split):
    _require(ranks)
    mesh = _mesh(ranks)
    cfgs = _cfgs()
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)  # a runtime per test: no warm-up programs (suite time)
    x, idx, w = _inputs(np.random.default_rng(7 + ranks + tokens), ranks, tokens)
    y_c, src_c = _round_trip_program(cfgs["cuda"], mesh, split)(x, idx, w)
    y_r, src_r = _round_trip_program(cfgs["reference"], mesh, False)(x, idx, w)
    np.testing.assert_array_equal(np.asarray(src_c), np.asarray(src_r))
    assert _rel(y_c, y_r) <= 2 ** -7, f"combine relative error {_rel(y_c, y_r):.2e}"


def test_consecutive_calls_without_combine_between():
    """Two dispatches back to back (the second reuses the other half), then both combines: each op must see its
    own data."""
    R = _upto(4)
    mesh = _mesh(R)
    cfgs = _cfgs()
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)  # a runtime per test: no warm-up programs (suite time)
    rng = np.random.default_rng(3)
    x1, idx1, w1 = _inputs(rng, R, T_MAX)
    x2, idx2, w2 = _inputs(rng, R, T_MAX)

    def program(cfg):
        def body(x1, idx1, w1, x2, idx2, w2):
            a = jax_ep.low_latency_dispatch(x1, idx1, cfg, use_fp8=False)
            b = jax_ep.low_latency_dispatch(x2, idx2, cfg, use_fp8=False)
            ya = jax_ep.low_latency_combine(a.recv_x, idx1, w1, a.handle, cfg)
            yb = jax_ep.low_latency_combine(b.recv_x, idx2, w2, b.handle, cfg)
            return ya, yb
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))

    got = program(cfgs["cuda"])(x1, idx1, w1, x2, idx2, w2)
    want = program(cfgs["reference"])(x1, idx1, w1, x2, idx2, w2)
    for g, r in zip(got, want):
        assert _rel(g, r) <= 2 ** -7


def _scan_program(cfg, mesh, steps, tokens):
    def body(x, key):
        me = lax.axis_index("ep")

        def step(carry, i):
            k = jax.random.fold_in(jax.random.fold_in(key[0], i), me)
            k1, k2 = jax.random.split(k)
            idx = jax.random.randint(k1, (tokens, K), -2, E + 2, dtype=jnp.int32)
            w = jax.random.uniform(k2, (tokens, K), jnp.float32)
            xi = x + (i % 5).astype(x.dtype)
            out = jax_ep.low_latency_dispatch(xi, idx, cfg, use_fp8=True)
            y = jax_ep.low_latency_combine(
                (out.recv_x.astype(jnp.float32) * out.recv_x_scales.repeat(128, axis=2)).astype(jnp.bfloat16),
                idx, w, out.handle, cfg)
            return carry + jnp.sum(out.recv_count), (y, out.recv_count)

        zero = jnp.zeros((), jnp.int32) + 0 * me
        total, (ys, counts) = lax.scan(step, zero, jnp.arange(steps))
        return total[None], ys[None], counts[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep")))


@pytest.mark.parametrize("steps", [2, 100])
def test_scan_consecutive_calls_changing_routing(steps):
    R = _upto(4)
    mesh = _mesh(R)
    cfgs = _cfgs()
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)  # a runtime per test: no warm-up programs (suite time)
    x = jnp.asarray(np.random.default_rng(11).normal(size=(R * 64, H)), jnp.bfloat16)
    key = jax.random.key_data(jax.random.key(steps))[None]
    compiled = _scan_program(cfgs["cuda"], mesh, steps, 64).lower(x, key).compile()
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""), "| command buffers in compiled HLO:",
          compiled.as_text().count("command_buffer"))
    t_c, y_c, n_c = jax.device_get(compiled(x, key))
    t_r, y_r, n_r = jax.device_get(_scan_program(cfgs["reference"], mesh, steps, 64)(x, key))
    np.testing.assert_array_equal(n_c, n_r)
    np.testing.assert_array_equal(t_c, t_r)
    # fp8 codes may differ by one step from XLA's conversion: allow a few bf16 ulps of the largest value
    assert _rel(y_c, y_r) <= 2 ** -5, f"relative error over {steps} steps {_rel(y_c, y_r):.2e}"


def test_gradients_match_reference():
    R = _upto(4)
    mesh = _mesh(R)
    cfgs = _cfgs()
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)  # a runtime per test: no warm-up programs (suite time)
    rng = np.random.default_rng(21)
    x, idx, w = _inputs(rng, R, 64)
    cot = jnp.asarray(rng.normal(size=(R * 64, H)), jnp.float32)

    assert_grads_close(ll_round_trip_grads(cfgs["cuda"], mesh, x, idx, w, cot),
                       ll_round_trip_grads(cfgs["reference"], mesh, x, idx, w, cot), ("d x", "d topk_weights"))


def test_compiled_hlo_uses_the_split_custom_calls():
    R = _upto(4)
    mesh = _mesh(R)
    cfgs = _cfgs()
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)  # a runtime per test: no warm-up programs (suite time)
    x, idx, w = _inputs(np.random.default_rng(1), R, 16)
    text = _round_trip_program(cfgs["cuda"], mesh, True).lower(x, idx, w).compile().as_text()
    for target in ("jax_ep_ll_dispatch_send_v5", "jax_ep_ll_dispatch_recv_v5", "jax_ep_ll_combine_send_v5",
                   "jax_ep_ll_combine_recv_v5"):
        assert target in text, target
    for collective in ("all-to-all", "all-gather", "all-reduce"):
        assert collective not in text, f"stray {collective} in the compiled LL program"
