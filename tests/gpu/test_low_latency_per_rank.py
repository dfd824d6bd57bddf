"""Low-latency per_rank mode (EPConfig.low_latency_mode="per_rank") on the CUDA backend against backend="reference".

Oracle: the reference backend's per_rank mode on the same GPUs (itself checked against the NumPy oracle's message
tables in the CPU suite, tests/test_reference_vs_oracle.py). Dispatch: counts, layout_range, src_info, msg_token,
token_rows and bf16 rows bit-identical, fp8 scales identical and codes within one e4m3 step; and bit-identical to
the CUDA per_expert dispatch (same rows, same order). Combine: within f32-accumulation tolerance of bf16 outputs
(the partial sums are summed in k order on both backends, but XLA's einsum may order the f32 adds differently).
Runs on as many GPUs as the machine has (R = 1, 2, 4).
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
from intranode_harness import assert_grads_close, ll_round_trip_grads, rel_error as _rel, require as _require, upto

E, H, K, T_MAX = 32, 2048, 8, 128


def _mesh(ranks):
    return Mesh(np.array(jax.devices("gpu")[:ranks]), ("ep",))


def _cfg(backend, mode="per_rank", hidden=H):
    return jax_ep.EPConfig(E, hidden, K, T_MAX, backend=backend, timeout_seconds=10.0, low_latency_mode=mode)


@pytest.fixture(autouse=True)
def _finalize():
    yield
    jax_ep.finalize()


def _inputs(rng, ranks, tokens, hidden=H):
    x = jnp.asarray(rng.normal(size=(ranks * tokens, hidden)) * 3, jnp.bfloat16)
    scores = np.abs(rng.normal(size=(ranks * tokens, E))) + 1
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.02] = E + 3  # out of range: treated as -1
    idx[:, -1] = np.where(rng.random(len(idx)) < 0.05, idx[:, 0], idx[:, -1])  # a repeated expert
    w = rng.random(size=(ranks * tokens, K)).astype(np.float32)
    w[idx < 0] = np.nan  # masked slots' weights are never used
    return x, jnp.asarray(idx), jnp.asarray(w)


def _dispatch_program(cfg, mesh, use_fp8, split):
    def body(x, idx):
        if split:
            out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=use_fp8),
                                                   cfg)
        else:
            out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=use_fp8)
        scales = out.recv_x_scales if use_fp8 else jnp.zeros((1,), jnp.float32)
        h = out.handle
        tables = (h.msg_token, h.token_rows) if h.msg_token is not None else (jnp.zeros((1,), jnp.int32),) * 2
        return (out.recv_x, scales, out.recv_count, h.src_info, h.layout_range) + tables

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep")))


def _group_upto(ranks):
    """(R, mesh, cuda config, reference config) over min(ranks, GPUs here) GPUs, initialized."""
    R = upto(ranks)
    mesh = _mesh(R)
    cuda, ref = _cfg("cuda"), _cfg("reference")
    jax_ep.initialize(mesh, cuda, ref)
    return R, mesh, cuda, ref


def _fp8_codes_close(a, b):
    ca, cb = np.asarray(a).view(np.uint8).astype(np.int32), np.asarray(b).view(np.uint8).astype(np.int32)
    same_sign = (ca & 0x80) == (cb & 0x80)
    both_zero = ((ca & 0x7F) == 0) & ((cb & 0x7F) == 0)
    return (same_sign & (np.abs((ca & 0x7F) - (cb & 0x7F)) <= 1)) | both_zero


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 64, 128])
@pytest.mark.parametrize("use_fp8", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_dispatch_matches_reference_and_per_expert(ranks, tokens, use_fp8, split):
    _require(ranks)
    mesh = _mesh(ranks)
    cuda, ref, cuda_pe = _cfg("cuda"), _cfg("reference"), _cfg("cuda", "per_expert")
    jax_ep.initialize(mesh, cuda, ref, cuda_pe)
    x, idx, _ = _inputs(np.random.default_rng(ranks * 100 + tokens), ranks, tokens)
    got = jax.device_get(_dispatch_program(cuda, mesh, use_fp8, split)(x, idx))
    want = jax.device_get(_dispatch_program(ref, mesh, use_fp8, False)(x, idx))
    per_expert = jax.device_get(_dispatch_program(cuda_pe, mesh, use_fp8, False)(x, idx))
    for name, i in (("recv_count", 2), ("src_info", 3), ("layout_range", 4), ("msg_token", 5), ("token_rows", 6)):
        np.testing.assert_array_equal(got[i], want[i], err_msg=name)
    for name, i in (("recv_count", 2), ("src_info", 3), ("layout_range", 4)):
        np.testing.assert_array_equal(got[i], per_expert[i], err_msg=f"{name} vs per_expert")
    num_local, rows = E // ranks, ranks * T_MAX
    valid = np.arange(rows)[None, :] < np.asarray(want[2]).reshape(ranks * num_local, 1)
    assert valid.sum() > 0
    g_x = got[0].reshape(ranks * num_local, rows, H)[valid]
    w_x = want[0].reshape(ranks * num_local, rows, H)[valid]
    p_x = per_expert[0].reshape(ranks * num_local, rows, H)[valid]
    view = np.uint8 if use_fp8 else np.uint16
    np.testing.assert_array_equal(np.asarray(g_x).view(view), np.asarray(p_x).view(view), err_msg="vs per_expert")
    if use_fp8:
        S = H // 128
        np.testing.assert_array_equal(got[1].reshape(-1, rows, S)[valid], want[1].reshape(-1, rows, S)[valid],
                                      err_msg="recv_x_scales")
        assert _fp8_codes_close(g_x, w_x).all()
    else:
        np.testing.assert_array_equal(np.asarray(g_x).view(np.uint16), np.asarray(w_x).view(np.uint16))


def _round_trip_program(cfg, mesh, split):
    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        scale = (1.0 + 0.25 * jnp.arange(out.recv_x.shape[0], dtype=jnp.float32))[:, None, None]
        expert_out = (out.recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        if split:
            return jax_ep.low_latency_combine_recv(
                jax_ep.low_latency_combine_send(expert_out, idx, w, out.handle, cfg), cfg)
        return jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 64, 128])
@pytest.mark.parametrize("split", [False, True])
def test_combine_matches_reference(ranks, tokens, split):
    _require(ranks)
    mesh = _mesh(ranks)
    cuda, ref, cuda_pe = _cfg("cuda"), _cfg("reference"), _cfg("cuda", "per_expert")
    jax_ep.initialize(mesh, cuda, ref, cuda_pe)
    x, idx, w = _inputs(np.random.default_rng(7 + ranks + tokens), ranks, tokens)
    y_c = np.asarray(_round_trip_program(cuda, mesh, split)(x, idx, w))
    y_r = np.asarray(_round_trip_program(ref, mesh, False)(x, idx, w))
    y_pe = np.asarray(_round_trip_program(cuda_pe, mesh, False)(x, idx, w))
    assert np.isfinite(y_c.astype(np.float32)).all(), "NaN weights of masked slots leaked into y"
    assert _rel(y_c, y_r) <= 2 ** -7, f"vs reference per_rank: {_rel(y_c, y_r):.2e}"
    assert _rel(y_c, y_pe) <= 2 ** -6, f"vs CUDA per_expert: {_rel(y_c, y_pe):.2e}"


def test_chained_calls_in_scan_with_changing_routing():
    """100 dispatch + combine steps in lax.scan, new random routing (with -1 and out-of-range ids) every step."""
    R, mesh, cuda, ref = _group_upto(4)

    def program(cfg):
        def body(x, key):
            me = lax.axis_index("ep")

            def step(carry, i):
                k1, k2 = jax.random.split(jax.random.fold_in(jax.random.fold_in(key[0], i), me))
                idx = jax.random.randint(k1, (64, K), -2, E + 2, dtype=jnp.int32)
                w = jax.random.uniform(k2, (64, K), jnp.float32)
                out = jax_ep.low_latency_dispatch(x + (i % 5).astype(x.dtype), idx, cfg, use_fp8=False)
                y = jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, cfg)
                return carry + jnp.sum(out.recv_count), (y, out.recv_count)

            total, (ys, counts) = lax.scan(step, jnp.zeros((), jnp.int32) + 0 * me, jnp.arange(100))
            return total[None], ys[None], counts[None]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep")))

    x = jnp.asarray(np.random.default_rng(5).normal(size=(R * 64, H)), jnp.bfloat16)
    key = jax.random.key_data(jax.random.key(3))[None]
    t_c, y_c, n_c = jax.device_get(program(cuda)(x, key))
    t_r, y_r, n_r = jax.device_get(program(ref)(x, key))
    np.testing.assert_array_equal(n_c, n_r)
    np.testing.assert_array_equal(t_c, t_r)
    assert _rel(y_c, y_r) <= 2 ** -7, f"relative error over 100 steps {_rel(y_c, y_r):.2e}"


def test_gradients_match_reference():
    R, mesh, cuda, ref = _group_upto(4)
    rng = np.random.default_rng(21)
    x, idx, w = _inputs(rng, R, 64)
    w = jnp.where(idx >= 0, w, 0.0)  # finite weights: the gradient reaches every slot
    cot = jnp.asarray(rng.normal(size=(R * 64, H)), jnp.float32)

    assert_grads_close(ll_round_trip_grads(cuda, mesh, x, idx, w, cot), ll_round_trip_grads(ref, mesh, x, idx, w, cot),
                       ("d x", "d topk_weights"))
