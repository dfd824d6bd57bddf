"""docs/API.md's expert-step examples run as written (inside shard_map, reference backend) and compute a dense MoE:
y[t] = sum_k topk_weights[t, k] * ffn(W[topk_idx[t, k]], x[t]). They show who applies the routing weights: the
expert step in normal mode (before combine), low_latency_combine in low-latency mode."""
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import ep_mesh

API = Path(__file__).resolve().parent.parent / "docs" / "API.md"
R, E, H, K, T = 4, 8, 128, 2, 8
L = E // R


def block_with(marker: str) -> str:
    """The one ```python block of docs/API.md that contains `marker`."""
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", API.read_text(), re.M | re.S) if marker in b]
    assert len(blocks) == 1, f"{len(blocks)} python blocks of docs/API.md contain {marker!r}"
    return blocks[0]


def ffn(w, h):
    return (h.astype(jnp.float32) @ w).astype(h.dtype)


def run_example(code: str, cfg, rng):
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    w_all = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (R * T, K)).astype(np.float32)

    def body(x, topk_idx, topk_weights, w_local):
        scope = dict(jax=jax, jnp=jnp, jax_ep=jax_ep, cfg=cfg, L=L, ffn=ffn, x=x, topk_idx=topk_idx,
                     topk_weights=topk_weights, w_local=w_local)
        exec(code, scope)  # the example as written
        return scope["y"]

    mesh = ep_mesh(R)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))
    y = np.asarray(f(jnp.asarray(x, jnp.bfloat16), idx, weights, w_all), np.float32)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    want = np.stack([sum(weights[t, k] * (xb[t] @ w_all[idx[t, k]]) for k in range(K)) for t in range(R * T)])
    return y, want


def test_normal_mode_expert_step_applies_the_weights_before_combine():
    cfg = jax_ep.EPConfig(E, H, K, T, backend="reference")
    y, want = run_example(block_with('jnp.einsum("ckl,ck->cl"'), cfg, np.random.default_rng(0))
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_low_latency_combine_applies_the_weights():
    cfg = jax_ep.EPConfig(E, H, K, T, backend="reference")
    y, want = run_example(block_with("jax.vmap(ffn)(w_local, out.recv_x)"), cfg, np.random.default_rng(1))
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
