"""Issue 14, CPU part: the reference backend accepts EPConfig.num_max_nvl_peers and gives the same results for every
split of an EP group into "nodes" (the split only changes how the CUDA kernels would move data, never what arrives).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import ep_mesh

R, E, H, K, T = 4, 16, 256, 4, 8


def _program(cfg):
    def body(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, cfg)
        y, yw = jax_ep.combine(out.recv_x, out.handle, cfg, topk_weights=out.recv_topk_weights)
        ll = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        bf = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        y_ll = jax_ep.low_latency_combine(bf.recv_x, idx, w, bf.handle, cfg)
        return (out.recv_x, out.recv_topk_idx, out.num_recv_tokens[None], y, yw,
                jax.lax.bitcast_convert_type(ll.recv_x, jnp.uint8), ll.recv_x_scales, ll.recv_count, y_ll)

    return jax.jit(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(P("ep"),) * 3, out_specs=P("ep")))


@pytest.mark.parametrize("mode", ["per_expert", "per_rank"])
def test_every_num_max_nvl_peers_gives_the_same_results(mode):
    rng = np.random.default_rng(14)
    x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    w = jnp.asarray(rng.random((R * T, K)), jnp.float32)
    results = {}
    for nvl in (1, 2, 4, 8):  # 4 nodes of 1, 2 of 2, 1 of 4, 1 (partly filled) of 8
        cfg = jax_ep.EPConfig(E, H, K, T, backend="reference", num_max_nvl_peers=nvl, low_latency_mode=mode)
        results[nvl] = [np.asarray(a) for a in _program(cfg)(x, jnp.asarray(idx), w)]
    for nvl in (1, 2, 4):
        for i, (a, b) in enumerate(zip(results[nvl], results[8])):
            assert a.dtype == b.dtype and a.shape == b.shape, (nvl, i)
            np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8),
                                          np.ascontiguousarray(b).view(np.uint8), err_msg=f"output {i}, nvl={nvl}")
    assert int(results[8][2].sum()) > 0  # something was dispatched


def test_groups_of_16_to_128_ranks():
    """Groups of 16, 32, 64 and 128 ranks on 128 emulated CPU devices, in a child process (the device count is fixed
    before jax starts; tests/programs/cpu/wide_group.py): normal-mode dispatch and combine and the low-latency ops
    (per_expert and per_rank) equal the oracle, every split into nodes (num_max_nvl_peers 1, 4, 8) gives the same
    bytes, and normal mode on the NVLink kernels refuses more than 8 ranks. About 70 s on 2 CPU cores (R=128: 30 s).
    R above kMaxGroupRanks (256) is tests/test_bad_inputs.py::test_initialize_and_ops_refuse_257_ranks."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=128", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(here, "programs", "cpu", "wide_group.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("OK ")] == \
        ["R=16", "R=32", "R=64", "R=128"], proc.stdout
