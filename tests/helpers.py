"""Shared test utilities: meshes, routing as DeepEP tests it, and sharded runners."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P


def ep_mesh(num_ranks: int, dp: int = 1) -> Mesh:
    """Mesh of the first dp * num_ranks devices (8 emulated CPU devices in CI; the GPUs on the GPU machine)."""
    if len(jax.devices()) < dp * num_ranks:
        import pytest
        pytest.skip(f"needs {dp * num_ranks} devices; this {jax.devices()[0].platform} machine has "
                    f"{len(jax.devices())}")
    devices = np.array(jax.devices()[: dp * num_ranks])
    if dp == 1:
        return Mesh(devices, ("ep",))
    return Mesh(devices.reshape(dp, num_ranks), ("dp", "ep"))


def random_topk(rng, num_tokens: int, num_experts: int, num_topk: int) -> np.ndarray:
    """DeepEP's test routing: scores |N(0,1)| + 1 per expert, top-k without repeats."""
    scores = np.abs(rng.normal(size=(num_tokens, num_experts))) + 1
    return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def sharded(fn, mesh: Mesh, num_in: int, spec=None):
    """jit(shard_map(fn)) with every input and output split along the leading axis over all mesh axes."""
    spec = spec or P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * num_in, out_specs=spec))


def bf16(a) -> jax.Array:
    return jnp.asarray(a, jnp.bfloat16)


def non_finite_rows(num_tokens, hidden, seed):
    """bf16 rows (as f32) whose blocks hold: NaN, +inf, -inf, all three, all non-finite, all zero, zeros + NaN, none,
    tiny (amax below 448 * 2^-126: the scale would be subnormal), and small values with f32-subnormal channels."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((num_tokens, hidden)) * rng.choice([1e-3, 1.0, 300.0], (num_tokens, 1)))
    x = x.astype(np.float32)
    blocks = x.reshape(num_tokens, -1, 128)
    cases = ["nan", "inf", "-inf", "mixed", "all_non_finite", "all_zero", "zero_and_nan", "finite", "tiny",
             "subnormal"]
    for t in range(num_tokens):
        for b in range(blocks.shape[1]):
            case = cases[(t * blocks.shape[1] + b) % len(cases)]
            ch = rng.choice(128, size=3, replace=False)
            if case == "nan":
                blocks[t, b, ch[0]] = np.nan
            elif case == "inf":
                blocks[t, b, ch[0]] = np.inf
            elif case == "-inf":
                blocks[t, b, ch[:2]] = -np.inf
            elif case == "mixed":
                blocks[t, b, ch] = [np.nan, np.inf, -np.inf]
                blocks[t, b, (ch[0] + 1) % 128] = -np.nan  # a NaN with its sign bit set
            elif case == "all_non_finite":
                blocks[t, b] = np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), 128)
            elif case == "all_zero":
                blocks[t, b] = 0.0
            elif case == "zero_and_nan":
                blocks[t, b] = 0.0
                blocks[t, b, ch[0]] = np.nan
            elif case == "tiny":  # amax ~ 1e-37 < 448 * 2^-126 ~ 5.3e-36, one channel just below the threshold
                blocks[t, b] = rng.standard_normal(128).astype(np.float32) * np.float32(1e-37)
                blocks[t, b, ch[0]] = -5.0e-36
            elif case == "subnormal":  # a normal block near the threshold (2^-110) with subnormal channels
                blocks[t, b] = rng.standard_normal(128).astype(np.float32) * np.float32(2.0 ** -110)
                blocks[t, b, ch[:2]] = [3.0e-39, -1.0e-39]
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # exactly representable in bf16
