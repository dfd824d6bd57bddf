"""The native extension as built on this machine: module metadata, and the CPU layout target through
jax.ffi.ffi_call (under jit and inside shard_map on 8 CPU devices) against a NumPy computation.

Skips (with the reason printed) when the extension was not built, e.g. no CUDA toolkit at build time.
"""

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ep import _native, buffer_layout

pytestmark = pytest.mark.skipif(
    not _native.available(), reason=f"native extension not built: {_native.load_error()}")


def numpy_layout(topk_idx, num_experts, num_ranks):
    """SPEC §3 layout, written independently of the C++ loop."""
    T, K = topk_idx.shape
    L = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    in_rank = np.zeros((T, num_ranks), bool)
    per_expert = np.zeros(num_experts, np.int32)
    for t in range(T):
        ids = set(int(e) for e in topk_idx[t][valid[t]])
        for e in ids:
            per_expert[e] += 1
            in_rank[t, e // L] = True
    return in_rank.sum(0).astype(np.int32), per_expert, in_rank


def routing(rng, T, K, E, mode):
    if mode == "random":
        return rng.integers(0, E, size=(T, K)).astype(np.int32)
    if mode == "distinct":
        return np.array([rng.permutation(E)[:K] for _ in range(T)], np.int32).reshape(T, K)
    # -1s, out-of-range ids (>= E and < -1) and repeats
    ids = rng.integers(-3, E + 3, size=(T, K)).astype(np.int32)
    ids[rng.random((T, K)) < 0.2] = -1
    if K > 1:
        ids[: T // 2, 1] = ids[: T // 2, 0]
    return ids


def test_module_metadata():
    m = _native.module()
    print("native info:", _native.info())
    assert isinstance(m.version(), str)
    major, minor = m.ffi_api_version()
    assert major == 0 and minor >= 1
    assert m.cuda_runtime_version() >= 12000
    regs = m.registrations()
    names = {(n, p) for n, p, _ in regs}
    assert ("jax_ep_layout_v1", "cpu") in names and ("jax_ep_layout_v1", "CUDA") in names
    assert all(n.endswith("_v1") for n, _, _ in regs)
    assert ("jax_ep_layout_v1", "cpu") in _native.ensure_registered()


@pytest.mark.parametrize("T,K,E,R", [(1, 1, 8, 2), (17, 8, 64, 4), (300, 4, 32, 8), (0, 2, 16, 4), (64, 16, 256, 8)])
@pytest.mark.parametrize("mode", ["random", "distinct", "messy"])
def test_layout_cpu_target_under_jit(T, K, E, R, mode):
    from jax_ep import _ffi

    rng = np.random.default_rng(zlib.crc32(repr((T, K, E, R, mode)).encode()))
    idx = routing(rng, T, K, E, mode)
    f = jax.jit(lambda i: _ffi.layout(i, num_experts=E, num_ranks=R))
    ntr, nte, itr = jax.device_get(f(jnp.asarray(idx)))
    rn, re, ri = numpy_layout(idx, E, R)
    assert ntr.dtype == np.int32 and nte.dtype == np.int32 and itr.dtype == np.bool_
    np.testing.assert_array_equal(ntr, rn)
    np.testing.assert_array_equal(nte, re)
    np.testing.assert_array_equal(itr, ri)


def test_layout_cpu_target_in_shard_map():
    from jax_ep import _ffi

    n = 8
    if len(jax.devices("cpu")) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices("cpu")[:n])
    T, K, E, R = 33, 6, 64, 8
    rng = np.random.default_rng(0)
    idx = routing(rng, n * T, K, E, "messy")

    def body(i):
        ntr, nte, itr = _ffi.layout(i, num_experts=E, num_ranks=R)
        return ntr[None], nte[None], itr

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"), P("ep"), P("ep"))))
    ntr, nte, itr = jax.device_get(f(jax.device_put(jnp.asarray(idx), NamedSharding(mesh, P("ep")))))
    for d in range(n):
        rn, re, ri = numpy_layout(idx[d * T:(d + 1) * T], E, R)
        np.testing.assert_array_equal(ntr[d], rn)
        np.testing.assert_array_equal(nte[d], re)
        np.testing.assert_array_equal(itr[d * T:(d + 1) * T], ri)


def test_layout_rejects_bad_attrs():
    from jax_ep import _ffi

    idx = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(Exception, match="num_experts must be a positive multiple"):
        jax.block_until_ready(jax.jit(lambda i: _ffi.layout(i, num_experts=10, num_ranks=4))(idx))


def test_buffer_formula_matches_native():
    m = _native.module()
    assert hasattr(m, "normal_buffer_bytes"), "the extension must export normal_buffer_bytes (stale build?)"
    for args in [(7168, 8, 4096, 4, 16384, 256), (2048, 1, 1, 2, 2, 8), (128, 16, 17, 8, 5, 64),
                 (4096, 4, 100, 2, 1000, 32)]:
        assert m.normal_buffer_bytes(*args) == buffer_layout.normal_buffer_bytes(*args), args


def test_low_latency_buffer_formula_matches_native():
    m = _native.module()
    assert hasattr(m, "low_latency_buffer_bytes"), "the extension must export low_latency_buffer_bytes (stale build?)"
    for args in [(7168, 128, 4, 288), (2048, 1, 2, 8), (7168, 64, 8, 256), (136, 3, 2, 6), (4096, 256, 8, 1024)]:
        assert m.low_latency_buffer_bytes(*args) == buffer_layout.low_latency_buffer_bytes(*args), args

