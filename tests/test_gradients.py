"""Gradients of a small MoE layer built on dispatch/combine equal the same layer computed densely on one device."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import ep_mesh

HIDDEN, FFN, TOPK = 128, 32, 2


def _params(rng, num_experts):
    return {
        "router": jnp.asarray(rng.normal(size=(HIDDEN, num_experts)) * 0.1, jnp.float32),
        "w_in": jnp.asarray(rng.normal(size=(num_experts, HIDDEN, FFN)) * 0.1, jnp.float32),
        "w_out": jnp.asarray(rng.normal(size=(num_experts, FFN, HIDDEN)) * 0.1, jnp.float32),
    }


def _route(x, router):
    logits = x.astype(jnp.float32) @ router
    top_logits, topk_idx = jax.lax.top_k(logits, TOPK)
    return topk_idx.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)


def dense_layer(params, x):
    """out[t] = sum_k w[t, k] * FFN_{e_k}(x[t]) with every expert on one device."""
    topk_idx, weights = _route(x, params["router"])
    xf = x.astype(jnp.float32)
    h = jax.nn.gelu(jnp.einsum("th,ehf->etf", xf, params["w_in"]))
    per_expert = jnp.einsum("etf,efh->eth", h, params["w_out"])  # [E, T, H]
    picked = per_expert[topk_idx, jnp.arange(x.shape[0])[:, None]]  # [T, K, H]
    return jnp.einsum("tk,tkh->th", weights, picked)


def ep_layer(params, x, cfg):
    """Same layer with experts sharded over 'ep': dispatch, local experts, combine."""
    topk_idx, weights = _route(x, params["router"])
    out = jax_ep.dispatch(x, topk_idx, weights, cfg)
    rows = out.recv_x.astype(jnp.float32)
    h = jax.nn.gelu(jnp.einsum("ch,lhf->lcf", rows, params["w_in"]))
    per_expert = jnp.einsum("lcf,lfh->lch", h, params["w_out"])  # [L, C, H]
    num_local = params["w_in"].shape[0]
    # weight of local expert l in row c: sum over k naming l (recv_topk_idx is -1 for other ranks' experts)
    onehot = out.recv_topk_idx[..., None] == jnp.arange(num_local)  # [C, K, L]
    coeff = jnp.einsum("ck,ckl->lc", out.recv_topk_weights, onehot.astype(jnp.float32))
    expert_out = jnp.einsum("lc,lch->ch", coeff, per_expert)
    y, _ = jax_ep.combine(expert_out, out.handle, cfg)
    return y


@pytest.mark.parametrize("num_ranks,dp", [(2, 1), (4, 1), (2, 2)])
def test_moe_layer_gradients_match_dense(num_ranks, dp):
    seed = np.random.SeedSequence().entropy % (2**31)
    rng = np.random.default_rng(seed)
    num_experts, tokens = 4 * num_ranks, 6
    cfg = jax_ep.EPConfig(num_experts, HIDDEN, TOPK, tokens, backend="reference")
    mesh = ep_mesh(num_ranks, dp)
    params = _params(rng, num_experts)
    groups = dp
    x = jnp.asarray(rng.normal(size=(groups, num_ranks * tokens, HIDDEN)), jnp.bfloat16)
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def ep_loss(params, x):
        spec_x = P("dp", "ep") if dp > 1 else P(None, "ep")
        p_specs = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}
        fn = jax.shard_map(lambda p, xs: ep_layer(p, xs[0], cfg)[None], mesh=mesh,
                           in_specs=(p_specs, spec_x), out_specs=spec_x)
        return jnp.sum(fn(params, x) * cot)

    def dense_loss(params, x):
        return jnp.sum(jax.vmap(lambda xs: dense_layer(params, xs))(x) * cot)

    ep_val, ep_grads = jax.jit(jax.value_and_grad(ep_loss, argnums=(0, 1)))(params, x)
    dn_val, dn_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1)))(params, x)
    # The loss sums terms of both signs: its rounding scales with the terms' magnitudes, not with the sum (a relative
    # bound on the sum fails when the terms cancel). A misrouted token moves it by about one token's terms, about
    # 1 / (groups * R * tokens) of the magnitude, far above this bound.
    dense_out = jax.jit(jax.vmap(lambda xs: dense_layer(params, xs)))(x)
    magnitude = float(jnp.sum(jnp.abs(dense_out * cot)))
    assert abs(float(ep_val) - float(dn_val)) <= 1e-6 * magnitude, (
        f"seed {seed}: loss {float(ep_val)} against {float(dn_val)} (terms' magnitude {magnitude})")
    flat_ep, _ = jax.tree.flatten(ep_grads)
    flat_dn, tree = jax.tree.flatten(dn_grads)
    for name, a, b in zip(jax.tree.leaves(jax.tree.unflatten(tree, [str(i) for i in range(len(flat_dn))])),
                          flat_ep, flat_dn):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)), f"seed {seed}: grad {name} has non-finite values"
        # x's cotangent passes through bf16 (recv_x is bf16); the rest is f32 end to end.
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12)
        assert rel < (1e-2 if a.shape == x.shape else 1e-4), f"seed {seed}: grad {name} rel err {rel}"
