"""The CUDA backend's staging plan (runtime.staging_plan / buffer_size_hint): [largest normal region | largest
low-latency region], the low-latency part only for configs that use it. Pure Python; the byte formulas themselves
are compared with the native ones in tests/test_native_build.py."""

from __future__ import annotations

import pytest

from jax_ep import EPConfig, buffer_layout, runtime

LL = EPConfig(288, 7168, 8, 128)        # decode-sized: low-latency buffers by default
NORMAL = EPConfig(256, 7168, 8, 4096)   # T_max > 256: none by default


def test_low_latency_buffers_default_and_overrides():
    assert LL.uses_low_latency_buffers() and not NORMAL.uses_low_latency_buffers()
    assert EPConfig(256, 7168, 8, 4096, low_latency_buffers=True).uses_low_latency_buffers()
    assert not EPConfig(288, 7168, 8, 128, low_latency_buffers=False).uses_low_latency_buffers()
    with pytest.raises(ValueError, match="low_latency_buffers"):
        EPConfig(288, 7168, 8, 128, low_latency_buffers="yes")


def test_staging_plan_is_largest_normal_then_largest_low_latency():
    # EP4 byte counts of the two regions (written out: 16384 staging rows of 4 * 7168 bytes + scales, topk, ...;
    # 288 experts x 128 slots x 14576-byte messages, two halves + scratch)
    normal_4096 = buffer_layout.normal_buffer_bytes(7168, 8, 4096, 4, 16384, 256)
    assert normal_4096 == 474548480
    ll_128 = buffer_layout.low_latency_buffer_bytes(7168, 128, 4, 288)
    assert ll_128 == 4096 + 2 * (3 * 1280 + 288 * 128 * 14576)  # scratch + 2 x (flags + messages)
    assert runtime.buffer_size_hint(NORMAL, 4).low_latency_bytes == 0
    assert runtime.buffer_size_hint(LL, 4).low_latency_bytes == ll_128
    total, offset, ll_bytes = runtime.staging_plan([LL, NORMAL], lambda c: 4)
    assert (offset, ll_bytes, total) == (normal_4096, ll_128, normal_4096 + ll_128)
    assert runtime.staging_plan([NORMAL], lambda c: 4) == (normal_4096, normal_4096, 0)
