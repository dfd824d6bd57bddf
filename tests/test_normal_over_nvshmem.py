"""Issue 14, CPU part of the normal mode over NVSHMEM (nvshmem/device/normal_send.cu; the GPU part is
tests/gpu/test_multiprocess_cuda.py): which kernels a group takes (EPConfig.normal_over_nvshmem), what the lowered
dispatch / cached dispatch / combine calls carry (nvshmem, nvl_domain), what initialize refuses, and the send area the
size hints add."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _native
from jax_ep.runtime import lifecycle
from helpers import ep_mesh, random_topk

R, E, H, K, T = 4, 8, 256, 2, 8
SPEC = P("ep")


def cfg(**kw):
    return jax_ep.EPConfig(E, H, K, T, **kw)


@pytest.mark.parametrize("nvl,num_ranks,want", [
    (8, 4, False),  # one NVLink domain: the NVLink kernels
    (4, 4, False),  # R = num_max_nvl_peers: still one domain
    (2, 4, True),   # two nodes of two
    (1, 2, True),   # two nodes of one (the simulated split on 2 GPUs)
    (1, 1, False),  # one rank: nothing to cross
])
def test_normal_over_nvshmem_is_a_group_wider_than_one_nvlink_domain(nvl, num_ranks, want):
    c = cfg(num_max_nvl_peers=nvl)
    assert c.normal_over_nvshmem(num_ranks) is want
    # allow_nvlink_for_low_latency is the low-latency kernels' choice only
    assert cfg(num_max_nvl_peers=nvl, allow_nvlink_for_low_latency=False).normal_over_nvshmem(num_ranks) is want


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Select the CUDA backend at trace time on this CPU machine (lowering only: nothing is compiled or run)."""
    from jax_ep import backends
    from jax_ep.ops import normal as ops_normal
    from jax_ep.backends import _ffi

    monkeypatch.setattr(_ffi._native, "ensure_registered", lambda: [])
    monkeypatch.setattr(ops_normal, "backend_for", lambda cfg, op, low_latency=False: backends.load_cuda())


_NORMAL_CALL = re.compile(r"stablehlo\.custom_call @(jax_ep_(?:dispatch|cached_dispatch|combine)_v\d+)\(.*\{(.*)$")


@pytest.mark.parametrize("nvl,want_nvshmem", [(8, 0), (4, 0), (2, 1), (1, 1)])
def test_lowered_normal_calls_carry_the_kernel_choice(cuda_lowering, nvl, want_nvshmem):
    """Every normal-mode target of a program (dispatch, the combine, and the cached dispatch of the combine's VJP)
    carries nvshmem = normal_over_nvshmem(R) and nvl_domain = num_max_nvl_peers."""
    c = cfg(num_max_nvl_peers=nvl)
    rng = np.random.default_rng(0)
    idx = jnp.asarray(np.concatenate([random_topk(rng, T, E, K) for _ in range(R)]))
    x = jnp.asarray(rng.normal(size=(R * T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.random(size=idx.shape), jnp.float32)

    def body(x, idx, w):
        def loss(x):
            o = jax_ep.dispatch(x, idx, w, c)
            y, _ = jax_ep.combine(o.recv_x, o.handle, c)
            return jnp.sum(y.astype(jnp.float32))

        return jax.grad(loss)(x)

    f = jax.jit(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC))
    text = f.trace(x, idx, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [m.groups() for m in map(_NORMAL_CALL.search, text.splitlines()) if m]
    targets = sorted({t for t, _ in calls})
    assert targets == ["jax_ep_cached_dispatch_v4", "jax_ep_combine_v4", "jax_ep_dispatch_v4"], targets
    for target, attrs in calls:
        assert re.search(rf"\bnvshmem = {want_nvshmem} : i32", attrs), (target, attrs)
        assert re.search(rf"\bnvl_domain = {nvl} : i32", attrs), (target, attrs)


def test_initialize_checks_for_the_nvshmem_normal_kernels():
    """They need one process per GPU, and the configs of one axis must make one choice (their barrier counters count
    each pair of ranks with one mechanism)."""
    two_nodes, one_node = cfg(num_max_nvl_peers=2), cfg(num_max_nvl_peers=8)
    lifecycle._check_normal_transport([two_nodes], {"ep": 4}, one_process_per_gpu=True)
    lifecycle._check_normal_transport([two_nodes], {"ep": 2}, one_process_per_gpu=False)  # fits one domain
    lifecycle._check_normal_transport([one_node, cfg(num_max_nvl_peers=4)], {"ep": 4}, one_process_per_gpu=False)
    with pytest.raises(jax_ep.EPError, match=r"'ep' \(R=4\).*num_max_nvl_peers=2.*one process per GPU"):
        lifecycle._check_normal_transport([two_nodes], {"ep": 4}, one_process_per_gpu=False)
    with pytest.raises(jax_ep.EPError, match=r"'ep' disagree on the normal-mode kernels"):
        lifecycle._check_normal_transport([one_node, two_nodes], {"ep": 4}, one_process_per_gpu=True)
    with pytest.raises(jax_ep.EPError, match=r"disagree"):  # both NVSHMEM, other NVLink domains
        lifecycle._check_normal_transport([two_nodes, cfg(num_max_nvl_peers=1)], {"ep": 4}, one_process_per_gpu=True)
    # other axes are independent
    other = jax_ep.EPConfig(E, H, K, T, axis_name="ep2", num_max_nvl_peers=8)
    lifecycle._check_normal_transport([two_nodes, other], {"ep": 4, "ep2": 4}, one_process_per_gpu=True)


@pytest.mark.skipif(not _native.available(), reason="the size hints come from the native extension, not built here")
def test_size_hints_add_the_send_area_exactly_when_the_normal_ops_run_over_nvshmem():
    m = _native.module()
    for nvl, num_ranks in ((1, 2), (2, 4), (8, 4)):
        c = cfg(num_max_nvl_peers=nvl, low_latency_buffers=False)
        over = c.normal_over_nvshmem(num_ranks)
        want = m.normal_buffer_bytes(H, K, T, num_ranks, c.capacity(num_ranks), E, over, nvl if over else 0)
        hint = jax_ep.buffer_size_hint(c, num_ranks)
        assert hint.normal_bytes == want and jax_ep.rdma_size_hint(c, num_ranks) == want
        plain = m.normal_buffer_bytes(H, K, T, num_ranks, c.capacity(num_ranks), E, False)
        assert (want > plain) is over


@pytest.mark.skipif(not _native.available(), reason="the forwarding areas come from the native layout, not built here")
def test_forwarded_dispatch_exactly_where_the_native_layout_has_forwarding_areas():
    """EPConfig.normal_dispatch_forwarded (Python) and the native layout's forward_nodes (C++, which the handlers also
    use to pick the hierarchical kernels) agree for every split: the buffer grows by the forwarding areas exactly
    when the config says its dispatch is forwarded."""
    m = _native.module()
    seen = set()
    for num_ranks in (2, 4, 6, 8, 12, 16, 32):
        for nvl in (1, 2, 3, 4, 8, 16):
            c = jax_ep.EPConfig(96, H, K, T, num_max_nvl_peers=nvl, low_latency_buffers=False)
            over = c.normal_over_nvshmem(num_ranks)
            if not over:
                assert not c.normal_dispatch_forwarded(num_ranks)
                continue
            args = (H, K, T, num_ranks, c.capacity(num_ranks), c.num_experts, True)
            grows = m.normal_buffer_bytes(*args, nvl) > m.normal_buffer_bytes(*args, 0)
            assert grows == c.normal_dispatch_forwarded(num_ranks), (num_ranks, nvl)
            assert jax_ep.buffer_size_hint(c, num_ranks).normal_bytes == m.normal_buffer_bytes(*args, nvl)
            seen.add(grows)
    assert seen == {True, False}  # both kinds of split were checked
