"""Fit to existing MoE code (docs/API.md): f32 activations in dispatch, and GShard-style token dropping through
capacity_mask, each checked against an independent NumPy statement of the rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import ep_mesh, random_topk

R, E, H, K, T = 4, 8, 128, 2, 8
CFG = jax_ep.EPConfig(E, H, K, T, backend="reference")


def _capacity_mask_numpy(idx, E, cap):
    out = np.full_like(idx, -1)
    counts = np.zeros(E, int)
    for t in range(idx.shape[0]):
        decided = {}
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if not 0 <= e < E:
                continue
            if e not in decided:
                decided[e] = counts[e] < cap
                counts[e] += 1
            if decided[e]:
                out[t, k] = e
    return out


@pytest.mark.parametrize("cap", [0, 1, 2, 5, 100])
def test_capacity_mask_matches_the_token_order_rule(cap):
    rng = np.random.default_rng(cap)
    idx = rng.integers(-2, E + 2, size=(T, 4)).astype(np.int32)
    idx[:, 3] = idx[:, 0]  # repeats are one pair
    cfg = jax_ep.EPConfig(E, H, 4, T, backend="reference")
    got = np.asarray(jax_ep.capacity_mask(jnp.asarray(idx), cfg, cap))
    np.testing.assert_array_equal(got, _capacity_mask_numpy(idx, E, cap))


def test_capacity_mask_errors_name_the_argument():
    idx = jnp.zeros((T, K), jnp.int32)
    with pytest.raises(jax_ep.EPError, match="capacity_per_expert"):
        jax_ep.capacity_mask(idx, CFG, -1)
    with pytest.raises(jax_ep.EPError, match="topk_idx"):
        jax_ep.capacity_mask(idx.astype(jnp.float32), CFG, 1)


def test_f32_dispatch_moves_bf16_and_returns_f32_gradients():
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.concatenate([random_topk(rng, T, E, K) for _ in range(R)]))
    x32 = jnp.asarray(rng.normal(size=(R * T, H)), jnp.float32)
    w = jnp.asarray(rng.random(size=idx.shape), jnp.float32)
    spec = P("ep")

    def recv(x):
        f = jax.shard_map(lambda x, i, w: jax_ep.dispatch(x, i, w, CFG).recv_x, mesh=ep_mesh(R),
                          in_specs=(spec,) * 3, out_specs=spec)
        return f(x, idx, w)

    got = recv(x32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(recv(x32.astype(jnp.bfloat16)), np.float32))
    cot = jnp.asarray(rng.normal(size=got.shape), jnp.bfloat16)
    dx = jax.grad(lambda x: jnp.sum(recv(x).astype(jnp.float32) * cot.astype(jnp.float32)))(x32)
    assert dx.dtype == jnp.float32
    # independent statement: dx[t] = sum of the bf16 cotangent rows that carry token t (f32 sum, not rounded)
    _, vjp = jax.vjp(lambda x: recv(x.astype(jnp.bfloat16)).astype(jnp.float32), x32.astype(jnp.float32))
    ref = vjp(cot.astype(jnp.float32))[0]
    np.testing.assert_allclose(np.asarray(dx), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
