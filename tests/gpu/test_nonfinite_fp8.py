"""Non-finite fp8 blocks on the GPUs (issue 13), for any number of GPUs R >= 1 (all visible GPUs form one EP group).

Low-latency fp8 dispatch quantizes in the kernel (cuda/kernels/low_latency_kernels.cu, quantize_segment); the rule is
jax_ep/fp8.py's (docs/API.md, "Errors and edge cases"): amax over the finite channels of each 128-channel block (0 if
none), the scale from it as for finite rows, and every NaN / +inf / -inf channel stored as the NaN code 0x7F. Rows
with NaN, +inf, -inf, all three, all-non-finite, all-zero and zero+NaN blocks go through the fused and the split
dispatch on the CUDA backend and on the reference backend on the same GPUs: recv_x bytes and scales of every valid row
must be bit-identical, and the NaN codes must sit exactly on the source token's non-finite channels.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuda_backend_harness as h  # tests/gpu is on sys.path
from helpers import non_finite_rows  # tests/ is on sys.path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep

SPEC = P("ep")
H, K, T = 1024, 4, 32  # H = one full kSegChannels segment per warp item: all lanes and both steps quantize
def _body(cfg, split):
    def f(x, idx):
        if split:
            out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=True), cfg)
        else:
            out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        return (jax.lax.bitcast_convert_type(out.recv_x, jnp.uint8), out.recv_x_scales, out.recv_count,
                out.handle.src_info, out.handle.layout_range)

    return f


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_fp8_dispatch_of_non_finite_rows_is_bit_identical_to_reference(split):
    h.require(1)
    R = len(h.gpu_devices())
    E = 8 * R
    L = E // R
    mesh = jax.sharding.Mesh(np.array(h.gpu_devices()), ("ep",))
    cuda = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    ref = jax_ep.EPConfig(E, H, K, T, backend="reference")
    jax_ep.initialize(mesh, cuda, ref)
    rng = np.random.default_rng(13)
    x_np = non_finite_rows(R * T, H, seed=13)
    idx = jnp.asarray(np.concatenate([h.routing(rng, T, K, E, "messy") for _ in range(R)]))
    x = jnp.asarray(x_np, jnp.bfloat16)
    non_finite = ~np.isfinite(np.asarray(x, np.float32))

    def run(cfg):
        f = jax.jit(jax.shard_map(_body(cfg, split), mesh=mesh, in_specs=(SPEC,) * 2, out_specs=SPEC))
        return [np.asarray(a) for a in f(x, idx)]

    got, want = run(cuda), run(ref)
    q_c, s_c, count, src_c, lay_c = got
    q_r, s_r, count_r, src_r, lay_r = want
    np.testing.assert_array_equal(count, count_r)
    np.testing.assert_array_equal(src_c, src_r)
    np.testing.assert_array_equal(lay_c, lay_r)
    q_c, q_r = q_c.reshape(R, L, R * T, H), q_r.reshape(R, L, R * T, H)
    s_c, s_r = s_c.reshape(R, L, R * T, H // 128), s_r.reshape(R, L, R * T, H // 128)
    count, src, lay = count.reshape(R, L), src_c.reshape(R, L, R * T), lay_c.reshape(R, L, R)
    rows = nan_codes = 0
    for r in range(R):
        for l_ in range(L):
            n = count[r, l_]
            np.testing.assert_array_equal(q_c[r, l_, :n], q_r[r, l_, :n], err_msg=f"recv_x bytes, rank {r} expert {l_}")
            np.testing.assert_array_equal(s_c[r, l_, :n], s_r[r, l_, :n], err_msg=f"scales, rank {r} expert {l_}")
            source_rank = np.repeat(np.arange(R), lay[r, l_])
            tokens = source_rank * T + src[r, l_, :n]
            np.testing.assert_array_equal(q_c[r, l_, :n] == 0x7F, non_finite[tokens],
                                          err_msg=f"NaN codes not exactly on the non-finite channels, rank {r}")
            assert np.isfinite(s_c[r, l_, :n]).all()
            rows += n
            nan_codes += int((q_c[r, l_, :n] == 0x7F).sum())
    assert rows > 0 and nan_codes > 0
    jax_ep.finalize()
