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
