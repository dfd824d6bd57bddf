"""The CUDA backend's staging plan (runtime.staging_plan / buffer_size_hint): [largest normal region | largest
low-latency region], the low-latency part only for configs that use it. The byte formulas live in C++
(cuda/include/jax_ep/staging_layout.h); these CPU tests check them against written-out numbers through the native
module (built in CI), and skip with the reason when it is not built."""

from __future__ import annotations

import dataclasses

import pytest

import jax_ep
from jax_ep import EPConfig, _native, runtime

needs_native = pytest.mark.skipif(not _native.available(), reason=f"native extension: {_native.load_error()}")

LL = EPConfig(288, 7168, 8, 128)        # decode-sized: low-latency buffers by default
NORMAL = EPConfig(256, 7168, 8, 4096)   # T_max > 256: none by default


def test_low_latency_buffers_default_and_overrides():
    assert LL.uses_low_latency_buffers() and not NORMAL.uses_low_latency_buffers()
    assert EPConfig(256, 7168, 8, 4096, low_latency_buffers=True).uses_low_latency_buffers()
    assert not EPConfig(288, 7168, 8, 128, low_latency_buffers=False).uses_low_latency_buffers()
    with pytest.raises(ValueError, match="low_latency_buffers"):
        EPConfig(288, 7168, 8, 128, low_latency_buffers="yes")


@needs_native
def test_staging_plan_is_largest_normal_then_largest_low_latency():
    m = _native.module()
    # EP4 byte counts of the two regions (written out: the 16384-byte signal header + counts + 4 x 64-byte receive
    # targets, with room for 8192 expert counts, + the count words (8 x (4 x 20 + 8192) bytes) + the notify scratch
    # (4 x 32 x (4 + 256) bytes), 16384 staging rows
    # of 4 * 7168 bytes + scales, topk, ...; 288 experts x 128 slots x 14576-byte
    # messages, the flags (c_flags u32 [288] and d_counts u32 [288]: 1280 bytes each, 256-aligned; d_flags u64 [288]:
    # 2304), the per_rank words (u32 [4][256]) and the weights area [R=4][128][16] f32, two halves + scratch
    # (4 * (1024 experts + 256 ranks)) + RDMA words (4096 + 2 * 8192))
    normal_4096 = m.normal_buffer_bytes(7168, 8, 4096, 4, 16384, 256)
    assert normal_4096 == 474695424
    ll_128 = m.low_latency_buffer_bytes(7168, 128, 4, 288)
    assert ll_128 == 5120 + 4096 + 16384 + 2 * (2 * 1280 + 2304 + 4096 + 288 * 128 * 14576 + 4 * 128 * 16 * 4)
    assert runtime.buffer_size_hint(NORMAL, 4).low_latency_bytes == 0
    assert runtime.buffer_size_hint(LL, 4).low_latency_bytes == ll_128
    total, offset, ll_bytes = runtime.staging_plan([LL, NORMAL], lambda c: 4)
    assert (offset, ll_bytes, total) == (normal_4096, ll_128, normal_4096 + ll_128)
    assert runtime.staging_plan([NORMAL], lambda c: 4) == (normal_4096, normal_4096, 0)


def test_buffer_size_hint_rejects_bad_num_ranks():
    for bad in (0, -2, 3, 2.0, True, "4"):
        with pytest.raises(jax_ep_error(), match="num_ranks|num_experts"):
            runtime.buffer_size_hint(NORMAL, bad)


def jax_ep_error():
    from jax_ep import EPError

    return EPError


@needs_native
def test_rdma_size_hint_is_all_symmetric_staging_with_send_slots_for_nvshmem_low_latency():
    """One process per GPU keeps a config's whole staging in the NVSHMEM heap: normal + LL region; with
    allow_nvlink_for_low_latency=False each LL half also holds the puts' send slots, E * T_max bf16 rows
    (the larger of those and T_max dispatch messages)."""
    m = _native.module()
    over = dataclasses.replace(LL, allow_nvlink_for_low_latency=False)
    assert jax_ep.rdma_size_hint(LL, 4) == runtime.buffer_size_hint(LL, 4).total_bytes
    slots = 288 * 128 * 2 * 7168  # > 128 messages of 14576 bytes
    assert jax_ep.rdma_size_hint(over, 4) - jax_ep.rdma_size_hint(LL, 4) == 2 * slots
    assert m.low_latency_buffer_bytes(7168, 128, 4, 288, True) == runtime.buffer_size_hint(over, 4).low_latency_bytes
    with pytest.raises(jax_ep_error(), match="num_ranks"):
        jax_ep.rdma_size_hint(LL, 0)


@needs_native
def test_the_peer_written_window_ends_at_one_offset_for_every_num_experts():
    """The configs of one axis share its staging, and a dispatch writes into the peers' counts, expert counts,
    receive targets (NVSHMEM kernels) or count words (NVLink kernels) with its count exchange as its only rendezvous:
    that window must end where it ends for every other config (staging_layout.h: room for kMaxLayoutExperts expert
    counts and count words), so rows another config's op may still be reading never lie under it. The rows then start
    128 (R + E) bytes of notify scratch later, 256-aligned."""
    m = _native.module()

    def up(n, a):
        return -(-n // a) * a

    for R in (1, 2, 4, 8):
        window = up(16384 + 4 * (R * R + jax_ep.config.MAX_NORMAL_EXPERTS + 4 * R + 4), 16) + 64 * R + 8 * (
            R * (R + 16) + jax_ep.config.MAX_NORMAL_EXPERTS)
        for E in (R, 8 * R, 256, 1024, 8192):
            if E % R:
                continue
            rows = m.normal_buffer_bytes(128, 1, 1, R, 1, E) - up(512 * R, 256) - 4 * 256  # H=128, T_max=1, C=1
            assert rows == up(window + 128 * (R + E), 256), (R, E)


@needs_native
def test_an_allocation_failure_names_the_buffers_and_recv_capacity(monkeypatch):
    """initialize's allocation failing for want of memory (cudaMalloc's "out of memory") becomes an EPError that
    gives each config's buffers per GPU and the setting that sizes them; other failures pass through unchanged. The
    CUDA transport is replaced by one that fails as the driver would, on the emulated CPU devices."""
    import jax
    import numpy as np

    from jax_ep.runtime import lifecycle, peer

    wide = EPConfig(256, 7168, 8, 4096, axis_name="ep")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("ep",))
    monkeypatch.setattr(lifecycle, "resolve_backend", lambda cfg, platform=None: "cuda")
    monkeypatch.setattr(lifecycle._native, "ensure_registered", lambda: None)

    def fail(message):
        def connect(groups, axes, buffer_bytes):
            raise RuntimeError(message)
        return connect

    monkeypatch.setattr(peer.PeerTransport, "connect", staticmethod(fail("cudaMalloc: out of memory")))
    with pytest.raises(jax_ep.EPError) as info:
        lifecycle._build(mesh, (wide,), [])
    text = str(info.value)
    normal = runtime.buffer_size_hint(wide, 8).normal_bytes / 2**30
    assert "out of memory" in text and "recv_capacity=32768 rows (the default" in text, text
    assert f"normal mode {normal:.2f} GiB" in text and "axis 'ep' (R=8" in text, text
    capped = dataclasses.replace(wide, recv_capacity=4096)
    with pytest.raises(jax_ep.EPError, match="recv_capacity=4096 rows, low latency 0.00 GiB"):
        lifecycle._build(mesh, (capped,), [])
    monkeypatch.setattr(peer.PeerTransport, "connect", staticmethod(fail("peer access refused")))
    with pytest.raises(RuntimeError, match="^peer access refused$"):
        lifecycle._build(mesh, (wide,), [])
