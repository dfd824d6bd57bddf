"""The custom_vjp rules (dispatch <-> combine transposes) equal plain autodiff through the reference backend.

`jax_ep.reference` is ordinary JAX (gathers, scatters, all_to_all), so jax.vjp through it is an independent
oracle for the hand-written backward passes that the CUDA backend also uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_ep
from jax_ep.backends import reference
from helpers import ep_mesh, random_topk, sharded

E, H, K, T = 8, 128, 3, 5


def _inputs(rng, num_ranks, capacity=None):
    cfg = jax_ep.EPConfig(E, H, K, T + 1, recv_capacity=capacity, backend="reference")
    idx = np.concatenate([random_topk(rng, T, E, K) for _ in range(num_ranks)])
    idx[rng.random(idx.shape) < 0.2] = -1  # some "no expert" slots
    x = jnp.asarray(rng.normal(size=(num_ranks * T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.random(idx.shape), jnp.float32)
    return cfg, x, jnp.asarray(idx), w


def _assert_close_bf16(got, want, msg):
    """Relative error in norm (bf16 roundings in different places: elementwise checks flake on cancellation)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{msg}: non-finite values"
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel < 1e-2, f"{msg}: relative error {rel:.2e}"


@pytest.mark.parametrize("num_ranks,capacity", [(2, None), (4, None), (4, 7)])
def test_dispatch_combine_vjp_equals_autodiff(num_ranks, capacity):
    seed = int(np.random.SeedSequence().entropy % (2**31))
    rng = np.random.default_rng(seed)
    cfg, x, idx, w = _inputs(rng, num_ranks, capacity)
    mesh = ep_mesh(num_ranks)
    C = cfg.capacity(num_ranks)
    cot_x = jnp.asarray(rng.normal(size=(num_ranks * C, H)), jnp.bfloat16)
    cot_w = jnp.asarray(rng.normal(size=(num_ranks * C, K)), jnp.float32)
    cot_y = jnp.asarray(rng.normal(size=(num_ranks * T, H)), jnp.float32)
    cot_yw = jnp.asarray(rng.normal(size=(num_ranks * T, K)), jnp.float32)
    scale = jnp.asarray(rng.normal(size=(num_ranks * C, 1)), jnp.float32)

    def program(dispatch_fn, combine_fn):
        def body(x, idx, w, cot_x, cot_w, cot_y, cot_yw, scale):
            def f(x, w):
                out = dispatch_fn(x, idx, w)
                # touch recv_x/recv_topk_weights directly (dispatch transpose) and through combine
                expert_out = out.recv_x.astype(jnp.float32) * scale
                y, yw = combine_fn(expert_out, out.handle, out.recv_topk_weights * scale)
                return (jnp.sum(out.recv_x.astype(jnp.float32) * cot_x) + jnp.sum(out.recv_topk_weights * cot_w)
                        + jnp.sum(y * cot_y) + jnp.sum(yw * cot_yw))
            g = jax.grad(f, argnums=(0, 1))(x, w)
            return g[0].astype(jnp.float32), g[1]
        return sharded(body, mesh, 8)(x, idx, w, cot_x, cot_w, cot_y, cot_yw, scale)

    ops = program(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg),
                  lambda v, h, w: jax_ep.combine(v, h, cfg, w))
    auto = program(lambda x, i, w: reference.dispatch(x, None, i, w, cfg, num_ranks),
                   lambda v, h, w: reference.combine(v, w, h, cfg, num_ranks))
    _assert_close_bf16(ops[0], auto[0], f"d x, seed {seed}")
    # The weight gradient is exact f32 arithmetic on both sides: demand it tightly.
    np.testing.assert_allclose(np.asarray(ops[1]), np.asarray(auto[1]), rtol=1e-5, atol=1e-5,
                               err_msg=f"seed {seed}")


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_low_latency_vjp_equals_autodiff(num_ranks):
    seed = int(np.random.SeedSequence().entropy % (2**31))
    rng = np.random.default_rng(seed)
    cfg, x, idx, w = _inputs(rng, num_ranks)
    mesh = ep_mesh(num_ranks)
    L, rows = E // num_ranks, num_ranks * cfg.max_tokens_per_rank
    cot_rows = jnp.asarray(rng.normal(size=(num_ranks * L, rows, H)), jnp.float32)
    cot_y = jnp.asarray(rng.normal(size=(num_ranks * T, H)), jnp.float32)

    def program(dispatch_fn, combine_fn):
        def body(x, idx, w, cot_rows, cot_y):
            def f(x, w):
                ll = dispatch_fn(x, idx)
                expert_out = (ll.recv_x.astype(jnp.float32) * 1.5).astype(jnp.bfloat16)
                y = combine_fn(expert_out, idx, w, ll.handle)
                return jnp.sum(ll.recv_x.astype(jnp.float32) * cot_rows) + jnp.sum(y.astype(jnp.float32) * cot_y)
            g = jax.grad(f, argnums=(0, 1))(x, w)
            return g[0].astype(jnp.float32), g[1]
        return sharded(body, mesh, 5)(x, idx, w, cot_rows, cot_y)

    state = jax_ep.LowLatencyState(jnp.zeros((4,), jnp.int32))  # plain autodiff: the state is not differentiated

    def ref_dispatch(x, idx):
        return reference.low_latency_dispatch(x, idx, state, cfg, num_ranks, False)[0]

    def ref_combine(out, idx, w, handle):
        return reference.low_latency_combine(out, idx, w, handle, state, cfg, num_ranks)[0]

    ops = program(lambda x, i: jax_ep.low_latency_dispatch(x, i, cfg, use_fp8=False),
                  lambda o, i, w, h: jax_ep.low_latency_combine(o, i, w, h, cfg))
    auto = program(ref_dispatch, ref_combine)
    _assert_close_bf16(ops[0], auto[0], f"d x, seed {seed}")
    _assert_close_bf16(ops[1], auto[1], f"d topk_weights, seed {seed}")
