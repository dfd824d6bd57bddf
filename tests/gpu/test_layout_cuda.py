"""The layout target (jax_ep_layout_v1) on one GPU against tests/oracle.py, for group sizes on both of the kernel's
rank-set paths: one 64-bit word (R <= 64, every NVLink group) and several (R > 64, the NVSHMEM groups), with -1 ids,
out-of-range ids and repeated experts, and T over one and several 1024-token tiles.

The CUDA layout (cuda/common/layout.cuh, block_layout) is the routing step inside every normal-mode dispatch; this
target runs it alone, so any R up to 256 runs on a single GPU.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import jax

import oracle  # tests/ is on sys.path
from cuda_backend_harness import require
from jax_ep.backends import _ffi

# (T, K, E, R): R = 1 and 64 are the one-word path's ends, 65 and 256 the wide path's; T = 1030 takes two tiles
CASES = [(5, 2, 8, 1), (300, 8, 256, 8), (300, 8, 256, 64), (300, 8, 260, 65), (1030, 16, 512, 128),
         (130, 16, 512, 256), (0, 4, 256, 256)]


def _routing(rng, T, K, E):
    """-1 ids, out-of-range ids (>= E and < -1) and a repeated expert in half of the tokens."""
    ids = rng.integers(-3, E + 3, size=(T, K)).astype(np.int32)
    ids[rng.random((T, K)) < 0.2] = -1
    if K > 1:
        ids[: T // 2, 1] = ids[: T // 2, 0]
    return ids


@pytest.mark.parametrize("T,K,E,R", CASES)
def test_layout_on_the_gpu_matches_the_oracle(T, K, E, R):
    require(1)
    rng = np.random.default_rng(zlib.crc32(repr((T, K, E, R)).encode()))
    idx = _routing(rng, T, K, E)
    gpu = jax.devices("gpu")[0]
    f = jax.jit(lambda i: _ffi.layout(i, num_experts=E, num_ranks=R))
    ntr, nte, itr = jax.device_get(f(jax.device_put(idx, gpu)))
    want = oracle.layout(np.broadcast_to(idx, (R, T, K)), E, R)  # every rank the same routing: rank 0's rows
    np.testing.assert_array_equal(ntr, want["num_tokens_per_rank"][0])
    np.testing.assert_array_equal(nte, want["num_tokens_per_expert"][0])
    np.testing.assert_array_equal(itr, want["is_token_in_rank"][0])
