"""The native extension as built on this machine, on CPU: its module surface (native_interface.md §1), the staging
arithmetic it owns, the axis bindings (no CUDA call), and the CPU layout target through jax.ffi.ffi_call (under jit
and inside shard_map on 8 CPU devices) against a NumPy computation.

Uses only the extension module and jax (not the rest of jax_ep), so it pins the native contract by itself. Skips,
with the reason printed, when the extension was not built (e.g. no CUDA toolkit at build time).
"""

import importlib
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

try:
    native = importlib.import_module("jax_ep._jax_ep_native")
    _skip_reason = None
except ImportError as e:  # not built (JAX_EP_NATIVE=OFF, no CUDA toolkit at build time) or broken
    native = None
    _skip_reason = f"jax_ep native extension not importable: {e}"
    print(_skip_reason)

pytestmark = pytest.mark.skipif(native is None, reason=_skip_reason or "")

LAYOUT = "jax_ep_layout_v1"
STATEFUL_TARGETS = {
    "jax_ep_dispatch_v4", "jax_ep_cached_dispatch_v4", "jax_ep_combine_v4",
    "jax_ep_low_latency_dispatch_v6", "jax_ep_low_latency_dispatch_send_v6", "jax_ep_low_latency_dispatch_recv_v6",
    "jax_ep_low_latency_combine_v6", "jax_ep_low_latency_combine_send_v6", "jax_ep_low_latency_combine_recv_v6",
}


def _is_capsule(obj) -> bool:
    return type(obj).__name__ == "PyCapsule"


# ---- module surface ---------------------------------------------------------------------------------------------
def test_module_metadata():
    assert isinstance(native.version(), str)
    major, minor = native.ffi_api_version()
    assert major == 0 and minor >= 2
    assert native.cuda_runtime_version() >= 12000
    print("native:", native.version(), "FFI", (major, minor), "CUDA runtime", native.cuda_runtime_version())


def test_registrations_list_v2_bundles_and_the_stateless_layout():
    regs = native.registrations()
    pairs = [(name, platform) for name, platform, _ in regs]
    assert len(pairs) == len(set(pairs)), "a target is listed twice"
    assert set(pairs) == {(LAYOUT, "cpu"), (LAYOUT, "CUDA")} | {(t, "CUDA") for t in STATEFUL_TARGETS}
    for name, platform, handler in regs:
        if name == LAYOUT:
            assert _is_capsule(handler), (name, platform)
        else:
            assert isinstance(handler, dict) and set(handler) == {"instantiate", "execute"}, name
            assert all(_is_capsule(h) for h in handler.values()), name
    # No v1 group targets (group ids in attributes are gone).
    assert not any(n.endswith("_v1") and n != LAYOUT for n, _ in pairs)


def test_state_types_are_registrable_pairs():
    types = native.state_types()
    assert len(types) >= 1
    names = [name for name, _ in types]
    assert len(names) == len(set(names))
    for name, reg in types:
        assert isinstance(name, str) and name
        assert set(reg) == {"type_id", "type_info"}
        assert _is_capsule(reg["type_id"]) and _is_capsule(reg["type_info"])


# ---- staging arithmetic, checked against numbers written out by hand -----------------------------------------------
# Normal region (staging_layout.h), hidden=128, num_topk=2, T_max=4, R=2, capacity=10, E=8:
#   rows = max(10, 2*4) = 10, scale columns = ceil(128/128) = 1
#   signals  align256(align16(16384 + 4 * (R*R + 8192 + 4R + 4)) = 49216 (room for kMaxLayoutExperts expert
#            counts: the peer-written window ends at the same offset for every E) + R * 64 receive targets
#            + count words 8 * (R * (R + 16) + 8192) = 65824 + notify scratch 4 * 32 * (R + E) = 1280) = 116480
#   payload  align256(10 * 4*128 = 5120)                    = 5120
#   scales / topk_idx / topk_weights / src_idx: align256(40 / 80 / 80 / 40) = 4 * 256
#   total = 116480 + 5120 + 1024 = 122624
# Low-latency region, hidden=128, T_max=4, R=2, E=8:
#   msg_stride = align16(16 + 2*128 + 4*1 = 276) = 288; rank_msg_stride = align16(144 + 260) = 416
#   flags: c_flags 0, d_flags 256 (u64 epoch words), d_counts 512, rank_words 768 (align256(4 * 4 * 256) = 4096),
#   rows at 4864
#   rows end = max(4864 + E*T_max*288 = 14080, 4864 + E*T_max*256 = 13056, 4864 + R*T_max*416 = 8192) = 14080
#   weights at 14080: R*T_max*16 f32 = 512 bytes -> one half = align256(14592) = 14592
#   total = LL_FIXED (scratch + RDMA words) + 2 * 14592
SMALL_NORMAL = dict(hidden=128, num_topk=2, max_tokens_per_rank=4, num_ranks=2, capacity=10, num_experts=8)
SMALL_LL = dict(hidden=128, max_tokens_per_rank=4, num_ranks=2, num_experts=8)


def test_normal_buffer_bytes_by_hand():
    assert native.normal_buffer_bytes(**SMALL_NORMAL) == 122624
    # capacity below R * T_max: the combine slots (R * T_max = 8 rows) decide; payload 8 * 512 = 4096
    assert native.normal_buffer_bytes(**{**SMALL_NORMAL, "capacity": 3}) == 116480 + 4096 + 4 * 256
    # DeepSeek-V3-like: H=7168 K=8 T_max=4096 R=4 C=16384 E=256 -> rows 16384, 56 scale columns
    #   signals: receive targets at align16(16384 + 4*(16 + 8192 + 16 + 4)) = 49296, 4 * 64 bytes of them, the
    #   count words 8 * (4 * 20 + 8192) = 66176, the notify scratch 4 * 32 * (4 + 256) = 33280, align256(149008) =
    #   149248; payload 16384*28672 = 469762048; scales 16384*224 = 3670016; topk 2 * 16384*32 = 1048576; src 65536
    assert native.normal_buffer_bytes(7168, 8, 4096, 4, 16384, 256) == (
        149248 + 469762048 + 3670016 + 1048576 + 65536)


def test_normal_buffer_bytes_with_the_nvshmem_send_area_by_hand():
    # nvshmem (EPConfig.normal_over_nvshmem): after src_idx, each piece aligned to 256, with meta records of
    # align16(4 * (2K + 1 + ceil(H/128)) = 24) = 32 bytes:
    #   remote_meta align256(rows 10 * 32 = 320) = 512; send_rows align256(rows 10 * 512) = 5120;
    #   send_meta align256(T_max 4 * R 2 * 32) = 256; send_weights align256(10 * 4 * K 2 = 80) = 256;
    #   expert_out align256(E 8 * 4) = 256
    assert native.normal_buffer_bytes(**SMALL_NORMAL, nvshmem=True) == 122624 + 512 + 5120 + 3 * 256
    # DeepSeek-V3-like at R=4 (rows 16384, K=8, 56 scale columns): records of align16(4 * (17 + 56)) = 304 bytes
    plain = native.normal_buffer_bytes(7168, 8, 4096, 4, 16384, 256)
    assert native.normal_buffer_bytes(7168, 8, 4096, 4, 16384, 256, nvshmem=True) == plain + (
        16384 * 304 + 16384 * 28672 + 4096 * 4 * 304 + 16384 * 32 + 1024)
    assert native.normal_buffer_bytes(**SMALL_NORMAL, nvshmem=False) == 122624
    # The send area does not grow with R * T_max (its rows are tokens, received rows or forward slots): at R=32 the
    # staging has max(C 10, R * T_max 128) = 128 rows, the send area C = 10: remote_meta align256(10 * 32) = 512,
    # send_rows 10 * 512 = 5120, send_meta T_max 4 * R 32 * 32 = 4096, send_weights 256, expert_out align256(32 * 4)
    wide = {**SMALL_NORMAL, "num_ranks": 32, "num_experts": 32}
    assert native.normal_buffer_bytes(**wide, nvshmem=True) == native.normal_buffer_bytes(**wide) + (
        512 + 5120 + 4096 + 256 + 256)


def test_normal_buffer_bytes_with_the_forwarding_areas_by_hand():
    # Hierarchical dispatch (nvshmem, nodes of nvl_domain = 2..8 ranks, >= 2 nodes): slots = (nodes - 1) * T_max (the
    # other nodes only), each area aligned to 256. R=4, nvl 2 -> 2 nodes, 4 slots; records of
    # align16(4 * (1 + 8 + 2K + ceil(H/128)) = 56) = 64:
    #   fwd_rows align256(4 * 512) = 2048; fwd_meta align256(4 * 64) = 256; send_fwd_meta 256
    # Node-first combine needs combine slots for this node's ranks and the forwarder's partials only: the staging's
    # rows are max(C, (nvl + nodes - 1) * T_max) = max(10, 12) = 12 instead of the flat max(C, R * T_max) = 16, so
    # the payload is 12 * 512 = 6144 instead of 8192 (the other per-row areas stay within their 256-byte blocks)
    four = {**SMALL_NORMAL, "num_ranks": 4}
    flat = native.normal_buffer_bytes(**four, nvshmem=True)
    assert native.normal_buffer_bytes(**four, nvshmem=True, nvl_domain=2) == flat - 2048 + 2048 + 256 + 256
    # no forwarding: nodes of 1 (flat puts), one node, a node size that does not divide R, no nvshmem
    for nvl in (0, 1, 3, 4):
        assert native.normal_buffer_bytes(**four, nvshmem=True, nvl_domain=nvl) == flat
    assert native.normal_buffer_bytes(**four, nvshmem=False, nvl_domain=2) == native.normal_buffer_bytes(**four)
    # nodes of more than kMaxNvlPeers = 8 ranks: flat (R=32, nvl 16); nvl 8 -> 4 nodes, 12 slots (768 bytes of
    # records per area, fwd_rows 12 * 512 = 6144). The staging shrinks from max(C 10, R * T_max 128) = 128 rows to
    # max(10, (8 + 3) * 4) = 44: payload 65536 -> 22528, scales 512 -> 256, topk_idx and topk_weights 1024 -> 512
    # each, src_idx 512 -> 256 (44544 bytes less); the send area keeps max(C, T_max) = 10 rows
    wide = {**SMALL_NORMAL, "num_ranks": 32, "num_experts": 32}
    wide_flat = native.normal_buffer_bytes(**wide, nvshmem=True)
    assert native.normal_buffer_bytes(**wide, nvshmem=True, nvl_domain=16) == wide_flat
    assert native.normal_buffer_bytes(**wide, nvshmem=True, nvl_domain=8) == wide_flat - 44544 + 6144 + 2 * 768
    with pytest.raises(ValueError, match="nvl_domain"):
        native.normal_buffer_bytes(**four, nvshmem=True, nvl_domain=-1)


def test_forwarding_layout_at_ep256_has_no_area_per_rank_and_token():
    """DeepSeek-V3-like shapes across 32 nodes of 8 (H=7168, K=8, T_max=4096, E=256, C=65536): the flat layout keeps
    a combine slot per (rank, token), R * T_max = 1048576 rows; node-first combine needs (nvl + nodes - 1) * T_max =
    159744 (this node's ranks, then the forwarder's partials per other node), and the forwarding areas add
    (nodes - 1) * T_max = 126976 rows of 28672 bytes and two records of align16(4 * (1 + 8 + 16 + 56)) = 336 bytes
    each. Per staging row: payload 4H = 28672, scales 56 * 4, topk_idx and topk_weights 8 * 4 each, src_idx 4."""
    args = (7168, 8, 4096, 256, 65536, 256)
    flat = native.normal_buffer_bytes(*args, nvshmem=True)
    forwarding = native.normal_buffer_bytes(*args, nvshmem=True, nvl_domain=8)
    per_row = 28672 + 224 + 32 + 32 + 4
    assert forwarding == flat - (1048576 - 159744) * per_row + 126976 * (28672 + 2 * 336)
    assert round(forwarding / 2**30, 2) == 9.85  # the EP256 row of docs/INTERNODE_SCALING.md's buffer table


# The fixed part of every LL region: scratch counters (4 * (1024 experts + 256 ranks)) and the RDMA words (consumed
# counters u64 [2][256] = 4096, then counted signals 2 * 8 * 1024).
LL_FIXED = 5120 + 4096 + 16384


def test_low_latency_buffer_bytes_by_hand():
    # halves of 14592: flags 3 * 256 (c_flags, d_flags of u64, d_counts), rank words 4096, rows 8 * 4 * 288 = 9216
    # (> combine 8 * 4 * 256), weights 512
    assert native.low_latency_buffer_bytes(**SMALL_LL) == LL_FIXED + 2 * 14592
    # staged (NVSHMEM puts): + send slots per half, the larger of T_max messages (4 * 416, per_rank's stride) and
    # the combine rows [E][T_max] (8 * 4 * 256 = 8192)
    assert native.low_latency_buffer_bytes(**SMALL_LL, staged=True) == LL_FIXED + 2 * (14592 + 8192)
    # H=7168 T_max=128 R=4 E=288: msg_stride = align16(16 + 14336 + 224) = 14576; flags: c_flags align256(4 * 288)
    # = 1280, d_flags (u64 epoch words) align256(8 * 288) = 2304, d_counts 1280; rank words 4096; rows end = 8960 +
    # 288*128*14576 = 537338624 (> the combine rows' and the per_rank messages'); weights 4*128*16*4 = 32768 ->
    # half = 537371392
    assert native.low_latency_buffer_bytes(7168, 128, 4, 288) == LL_FIXED + 2 * 537371392


def test_staging_plan_by_hand():
    # [normal = max(normal) | LL = max(low_latency)], low_latency_offset = aligned end of the normal region
    assert native.staging_plan([17408, 3000], [24576, 1024]) == (17408 + 24576, 17408, 24576)
    assert native.staging_plan([17408], []) == (17408, 17408, 0)
    # the normal region never ends before the signal header; low_latency_offset is 256-aligned
    assert native.staging_plan([], []) == (16384, 16384, 0)
    assert native.staging_plan([1000], [5120]) == (16384 + 5120, 16384, 5120)
    assert native.staging_plan([16400], []) == (16640, 16640, 0)
    plan = native.staging_plan([native.normal_buffer_bytes(**SMALL_NORMAL)], [native.low_latency_buffer_bytes(**SMALL_LL)])
    ll = LL_FIXED + 2 * 14592
    assert plan == (122624 + ll, 122624, ll)


def test_staging_rejects_bad_arguments():
    with pytest.raises(ValueError, match="capacity must be positive"):
        native.normal_buffer_bytes(**{**SMALL_NORMAL, "capacity": 0})
    with pytest.raises(ValueError, match="hidden must be positive"):
        native.low_latency_buffer_bytes(**{**SMALL_LL, "hidden": -1})
    with pytest.raises(ValueError, match=r"low_latency\[0\] must be >= 0"):
        native.staging_plan([1024], [-5])


# ---- axis bindings (no GPU needed) -------------------------------------------------------------------------------
def test_bind_unbind_round_trip():
    axis = "jax_ep_test_native_build_axis"
    try:
        assert axis not in native.bound_axes()
        native.bind_axis(axis, 7, 17408, 24576)
        assert native.bound_axes()[axis] == {"set_id": 7, "low_latency_offset": 17408, "low_latency_bytes": 24576}
        native.bind_axis(axis, 9, 1024, 0)  # rebinding replaces
        assert native.bound_axes()[axis] == {"set_id": 9, "low_latency_offset": 1024, "low_latency_bytes": 0}
    finally:
        native.unbind_axis(axis)
    assert axis not in native.bound_axes()
    native.unbind_axis(axis)  # unbinding an unbound axis is fine


def test_bind_axis_rejects_bad_arguments():
    axis = "jax_ep_test_native_build_bad"
    with pytest.raises(ValueError, match="low_latency_offset must be a multiple of 256"):
        native.bind_axis(axis, 1, 4096, 4096)      # inside the signal header
    with pytest.raises(ValueError, match="low_latency_offset must be a multiple of 256"):
        native.bind_axis(axis, 1, 16400, 4096)     # misaligned
    with pytest.raises(ValueError, match="set_id must be >= 0"):
        native.bind_axis(axis, -1, 1024, 0)
    with pytest.raises(ValueError, match="axis name is empty"):
        native.bind_axis("", 1, 1024, 0)
    assert axis not in native.bound_axes()


# ---- the CPU layout target ----------------------------------------------------------------------------------------
def _register_cpu_layout():
    # Registering the same handler again is allowed by XLA (the jax_ep package registers the same capsule).
    (handler,) = [h for n, p, h in native.registrations() if (n, p) == (LAYOUT, "cpu")]
    jax.ffi.register_ffi_target(LAYOUT, handler, platform="cpu")


def layout(topk_idx, num_experts, num_ranks):
    _register_cpu_layout()
    T = topk_idx.shape[0]
    out = (jax.ShapeDtypeStruct((num_ranks,), jnp.int32), jax.ShapeDtypeStruct((num_experts,), jnp.int32),
           jax.ShapeDtypeStruct((T, num_ranks), jnp.bool_))
    return jax.ffi.ffi_call(LAYOUT, out)(topk_idx, num_experts=np.int32(num_experts), num_ranks=np.int32(num_ranks))


def on_cpu(a):
    return jax.device_put(np.asarray(a), jax.local_devices(backend="cpu")[0])


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


@pytest.mark.parametrize("T,K,E,R", [(1, 1, 8, 2), (17, 8, 64, 4), (300, 4, 32, 8), (0, 2, 16, 4), (64, 16, 256, 8),
                                     (300, 8, 260, 65), (130, 16, 512, 256)])
@pytest.mark.parametrize("mode", ["random", "distinct", "messy"])
def test_layout_cpu_target_under_jit(T, K, E, R, mode):
    rng = np.random.default_rng(zlib.crc32(repr((T, K, E, R, mode)).encode()))
    idx = routing(rng, T, K, E, mode)
    f = jax.jit(lambda i: layout(i, E, R))
    ntr, nte, itr = jax.device_get(f(on_cpu(idx)))
    rn, re, ri = numpy_layout(idx, E, R)
    assert ntr.dtype == np.int32 and nte.dtype == np.int32 and itr.dtype == np.bool_
    np.testing.assert_array_equal(ntr, rn)
    np.testing.assert_array_equal(nte, re)
    np.testing.assert_array_equal(itr, ri)


def test_layout_cpu_target_in_shard_map():
    n = 8
    if len(jax.devices("cpu")) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count={n})")
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices("cpu")[:n])
    T, K, E, R = 33, 6, 64, 8
    rng = np.random.default_rng(0)
    idx = routing(rng, n * T, K, E, "messy")

    def body(i):
        ntr, nte, itr = layout(i, E, R)
        return ntr[None], nte[None], itr

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=(P("ep"), P("ep"), P("ep"))))
    ntr, nte, itr = jax.device_get(f(jax.device_put(jnp.asarray(idx), NamedSharding(mesh, P("ep")))))
    for d in range(n):
        rn, re, ri = numpy_layout(idx[d * T:(d + 1) * T], E, R)
        np.testing.assert_array_equal(ntr[d], rn)
        np.testing.assert_array_equal(nte[d], re)
        np.testing.assert_array_equal(itr[d * T:(d + 1) * T], ri)


def test_layout_rejects_bad_attrs():
    idx = on_cpu(np.zeros((4, 2), np.int32))
    with pytest.raises(Exception, match="num_experts must be a positive multiple"):
        jax.block_until_ready(jax.jit(lambda i: layout(i, 10, 4))(idx))


def test_direct_buffer_controls_and_pointer_facts():
    # the switch of docs/API.md "Direct buffers" round-trips, and an address no allocation holds is never taken for
    # a peer-addressable buffer (no driver here: query_result -1; with a GPU: no allocation range)
    was = native.direct_buffers_enabled()
    native.set_direct_buffers(not was)
    assert native.direct_buffers_enabled() == (not was)
    native.set_direct_buffers(was)
    assert native.direct_buffers_enabled() == was
    facts = native.pointer_facts(0x1000)
    assert set(facts) == {"query_result", "legacy_ipc", "from_pool", "range_start", "range_size", "device", "access"}
    assert facts["legacy_ipc"] == 0 and facts["range_size"] == 0 and len(facts["access"]) == 8
    assert all(a != 3 for a in facts["access"]), facts


def test_pull_combine_threshold_control():
    # docs/API.md "Direct buffers": the threshold round-trips and refuses a negative value (its default equals the
    # Python side's: tests/test_nvshmem_env.py)
    was = native.pull_combine_min_bytes()
    assert was >= 0
    try:
        native.set_pull_combine_min_bytes(0)
        assert native.pull_combine_min_bytes() == 0
        with pytest.raises(ValueError, match="bytes must be 0 or more"):
            native.set_pull_combine_min_bytes(-1)
        assert native.pull_combine_min_bytes() == 0
    finally:
        native.set_pull_combine_min_bytes(was)
    assert native.pull_combine_min_bytes() == was
