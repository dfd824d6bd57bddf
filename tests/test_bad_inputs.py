"""Bad inputs and edge cases of issue 13 that a CPU can check (reference backend, emulated devices).

Each error case asserts the exact exception type and that the message names the argument (and, for a mismatch,
both values). docs/API.md, "Errors and edge cases", states the rules tested here: handle/config matching, the CUDA
kernels' limits validated on every backend, the non-finite fp8 rule, masked top-k weights, and which ops have no
gradient. Small shapes: the whole file runs in well under a minute on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import config, fp8
from jax_ep.ops import validation
import oracle as O
from helpers import config_maker, ep_mesh, non_finite_rows, run_sharded, sharded

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = P("ep")
R, E, H, K, T = 2, 4, 128, 2, 4


cfg = config_maker(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T)
run = functools.partial(run_sharded, num_ranks=R)


def trace(body, *args, num_ranks=R):
    """Traces (no compilation): trace-time checks run, nothing is executed."""
    return sharded(body, ep_mesh(num_ranks), len(args)).trace(*args)


def inputs(t=T, h=H, k=K, num_ranks=R, seed=0, experts=E):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_ranks * t, h)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.permutation(experts)[:k] for _ in range(num_ranks * t)]).astype(np.int32))
    w = jnp.asarray(rng.random((num_ranks * t, k)), jnp.float32)
    return x, idx, w


class raises:
    """`with raises(EPError, "name", ...)`: exactly that exception type, and each string in its message."""

    def __init__(self, exc_type, *names):
        self.exc_type, self.names = exc_type, names

    def __enter__(self):
        return self

    def __exit__(self, typ, value, tb):
        assert value is not None, f"expected {self.exc_type.__name__} naming {self.names}, nothing was raised"
        assert type(value) is self.exc_type, f"expected exactly {self.exc_type.__name__}, got {typ.__name__}: {value}"
        for name in self.names:
            assert name in str(value), f"{name!r} not in the message: {value}"
        self.message = str(value)
        return True


# ---- EPConfig --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("np_int", [np.int32, np.int64])
def test_config_accepts_numpy_integers_and_normalizes_them(np_int):
    fields = dict(num_experts=8, hidden=256, num_topk=2, max_tokens_per_rank=16, recv_capacity=32,
                  num_max_nvl_peers=8, num_sms=20, timeout_seconds=30)
    plain = jax_ep.EPConfig(**fields)
    numpy = jax_ep.EPConfig(**{k: np_int(v) for k, v in fields.items()})
    assert numpy == plain and hash(numpy) == hash(plain)
    for name in fields:
        want = float if name == "timeout_seconds" else int
        assert type(getattr(numpy, name)) is want, name
    assert jax_ep.EPConfig(8, 256, 2, 16, timeout_seconds=np.float32(2.5)).timeout_seconds == 2.5
    assert jax_ep.EPConfig(8, 256, 2, 16, low_latency_buffers=np.bool_(True)) == jax_ep.EPConfig(
        8, 256, 2, 16, low_latency_buffers=True)


@pytest.mark.parametrize("field,value,message", [
    ("timeout_seconds", "100", "EPConfig.timeout_seconds must be a number > 0"),
    ("timeout_seconds", 0, "EPConfig.timeout_seconds must be a number > 0"),
    ("timeout_seconds", -1.0, "EPConfig.timeout_seconds must be a number > 0"),
    ("timeout_seconds", math.nan, "EPConfig.timeout_seconds must be a number > 0"),
    ("timeout_seconds", math.inf, "EPConfig.timeout_seconds must be a number > 0"),
    ("timeout_seconds", True, "EPConfig.timeout_seconds must be a number > 0"),
    ("num_experts", "8", "EPConfig.num_experts must be a positive int"),
    ("num_experts", np.float64(8.0), "EPConfig.num_experts must be a positive int"),
    ("hidden", True, "EPConfig.hidden must be a positive int"),
    ("max_tokens_per_rank", np.int64(0), "EPConfig.max_tokens_per_rank must be a positive int"),
    ("num_sms", None, "EPConfig.num_sms must be a positive int"),
    ("recv_capacity", "32", "EPConfig.recv_capacity must be a positive int"),
    ("num_topk", 17, "EPConfig.num_topk must be in [1, 16]"),
    ("low_latency_buffers", "yes", "EPConfig.low_latency_buffers must be None, True or False"),
    ("axis_name", 3, "EPConfig.axis_name must be a non-empty str"),
    ("backend", None, "EPConfig.backend must be one of"),
])
def test_config_rejects_bad_fields_with_ep_error(field, value, message):
    with raises(jax_ep.EPError, message):
        cfg(**{field: value})
    assert issubclass(jax_ep.EPError, ValueError)


# ---- the CUDA kernels' limits: one validation, every backend ------------------------------------------------------
def _header_constant(text, name):
    m = re.search(rf"constexpr\s+[\w:]+\s+{name}\s*=\s*(\d+)\s*;", text)
    assert m, f"{name} not found in cuda/include/jax_ep/constants.h"
    return int(m.group(1))


def test_python_limits_equal_the_cuda_headers():
    header = (ROOT / "cuda/include/jax_ep/constants.h").read_text()
    for py, cpp in [("MAX_TOPK", "kMaxTopk"), ("MAX_GROUP_RANKS", "kMaxGroupRanks"), ("MAX_NVL_PEERS", "kMaxNvlPeers"),
                    ("MAX_NORMAL_EXPERTS", "kMaxLayoutExperts"), ("MAX_LOW_LATENCY_EXPERTS", "kMaxLowLatencyExperts"),
                    ("FP8_BLOCK", "kFp8Block")]:
        assert getattr(config, py) == _header_constant(header, cpp), (py, cpp)
    # the 16-byte row rule has no named C++ constant: the handlers check the literal
    assert f"row_bytes % {config.ROW_ALIGN_BYTES} == 0" in (ROOT / "xla_ffi/normal_ffi.cc").read_text()
    assert f"hidden % {config.HIDDEN_MULTIPLE} != 0" in (ROOT / "xla_ffi/op_state.cc").read_text()


def test_bf16_hidden_must_be_a_multiple_of_8_on_every_backend():
    c = cfg(hidden=100)
    x, idx, w = inputs(h=100)
    with raises(jax_ep.EPError, "jax_ep.dispatch", "cfg.hidden=100", "multiple of 8"):
        trace(lambda x, i, w: jax_ep.dispatch(x, i, w, c).recv_x, x, idx, w)
    with raises(jax_ep.EPError, "jax_ep.low_latency_dispatch", "cfg.hidden=100", "multiple of 8"):
        trace(lambda x, i: jax_ep.low_latency_dispatch(x, i, c, use_fp8=False).recv_x, x, idx)


def test_expert_limits_per_mode():
    x, idx, w = inputs()
    ll = cfg(num_experts=2048)
    with raises(jax_ep.EPError, "jax_ep.low_latency_dispatch", "cfg.num_experts=2048", "1024",
                "kMaxLowLatencyExperts"):
        trace(lambda x, i: jax_ep.low_latency_dispatch(x, i, ll, use_fp8=False).recv_x, x, idx)
    trace(lambda x, i, w: jax_ep.dispatch(x, i, w, ll).recv_x, x, idx, w)  # normal mode allows 2048
    big = cfg(num_experts=16384)
    for op, body in [("jax_ep.dispatch", lambda x, i, w: jax_ep.dispatch(x, i, w, big).recv_x),
                     ("jax_ep.get_dispatch_layout", lambda x, i, w: jax_ep.get_dispatch_layout(i, big).is_token_in_rank)]:
        with raises(jax_ep.EPError, op, "cfg.num_experts=16384", "8192", "kMaxLayoutExperts"):
            trace(body, x, idx, w)


def test_group_ranks_limit():
    """R <= kMaxGroupRanks = 256 in both modes; 257 is an EPError naming the limit (the ops' check alone; the real
    path, initialize and traced ops on 257 devices, is test_initialize_and_ops_refuse_257_ranks)."""
    assert config.MAX_GROUP_RANKS == 256
    validation.check_kernel_limits("dispatch", cfg(num_experts=512), 256, low_latency=False)
    validation.check_kernel_limits("low_latency_dispatch", cfg(num_experts=512), 256, low_latency=True)
    for low_latency in (False, True):
        with raises(jax_ep.EPError, "jax_ep.dispatch", "257 ranks", "at most 256", "kMaxGroupRanks"):
            validation.check_kernel_limits("dispatch", cfg(num_experts=514), 257, low_latency=low_latency)


def test_initialize_and_ops_refuse_257_ranks():
    """An EP group of 257 ranks (one above kMaxGroupRanks) on 257 emulated CPU devices, in a child process (the device
    count is fixed before jax starts; tests/programs/cpu/group_limit.py): jax_ep.initialize, buffer_size_hint and
    every op (traced, nothing compiled) raise an EPError naming the axis, 257 ranks, the limit 256 and
    kMaxGroupRanks, on every backend ("reference", "auto", "cuda"), and a refused initialize keeps the runtime it
    had; 256 ranks pass initialize and the ops' checks. About 2 s."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=257", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "programs" / "cpu" / "group_limit.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
    for backend in ("reference", "auto", "cuda"):
        for what in ("initialize", "buffer_size_hint", "get_dispatch_layout", "dispatch", "combine",
                     "low_latency_dispatch", "low_latency_dispatch_send", "low_latency_combine",
                     "low_latency_combine_send"):
            assert any(line.startswith(f"OK {what} backend={backend} R=257") for line in lines), (what, backend,
                                                                                                 proc.stdout)
    assert sum(line.endswith("R=256 accepted") for line in lines) == 8, proc.stdout


def test_normal_mode_on_the_nvlink_kernels_takes_at_most_8_ranks():
    """R > 8 in normal mode needs the NVSHMEM kernels (R > num_max_nvl_peers); the NVLink kernels' per-token
    destination arrays hold 8 ranks. Low-latency mode has no such limit."""
    wide = cfg(num_experts=16, num_max_nvl_peers=16)
    with raises(jax_ep.EPError, "jax_ep.dispatch", "16 ranks", "num_max_nvl_peers=16", "at most 8", "kMaxNvlPeers"):
        validation.check_kernel_limits("dispatch", wide, 16, low_latency=False)
    validation.check_kernel_limits("low_latency_dispatch", wide, 16, low_latency=True)
    validation.check_kernel_limits("dispatch", wide, 8, low_latency=False)
    validation.check_kernel_limits("dispatch", cfg(num_experts=16, num_max_nvl_peers=8), 16, low_latency=False)


# ---- handle / config mismatches ------------------------------------------------------------------------------------
def test_issue_reproducer_combine_with_a_smaller_max_tokens_is_an_error():
    """dispatch with max_tokens_per_rank=8, combine with 4 (same capacity): was silently wrong rows, now an error."""
    a = jax_ep.EPConfig(8, 128, 2, 8, recv_capacity=32, backend="reference")
    b = jax_ep.EPConfig(8, 128, 2, 4, recv_capacity=32, backend="reference")
    x = jnp.asarray(np.arange(24)[:, None] * np.ones((1, 128)), jnp.bfloat16)
    idx = jnp.tile(jnp.array([[0, 1]], jnp.int32), (24, 1))
    w = jnp.ones((24, 2), jnp.float32)

    def body(x, i, w):
        out = jax_ep.dispatch(x, i, w, a)
        return jax_ep.combine(out.recv_x, out.handle, b)[0]

    with raises(jax_ep.EPError, "jax_ep.combine", "handle.send_pos", "T=6", "cfg.max_tokens_per_rank=4"):
        trace(body, x, idx, w, num_ranks=4)


def test_combine_with_another_capacity_names_both_values():
    a, b = cfg(max_tokens_per_rank=8), cfg()  # C = R * T_max: 16 vs 8
    x, idx, w = inputs()

    def body(x, i, w):
        out = jax_ep.dispatch(x, i, w, a)
        return jax_ep.combine(jnp.zeros((8, H), jnp.bfloat16), out.handle, b)[0]

    with raises(jax_ep.EPError, "jax_ep.combine", "handle.recv_src_idx has 16 rows", "capacity is 8",
                "cfg.recv_capacity=None"):
        trace(body, x, idx, w)


def test_combine_with_a_handle_of_another_group_size():
    x, idx, w = inputs()

    def body(x, i, w):
        out = jax_ep.dispatch(x, i, w, cfg())
        h = out.handle
        other = h._replace(send_pos=jnp.zeros((T, 3), jnp.int32))
        return jax_ep.combine(out.recv_x, other, cfg())[0]

    with raises(jax_ep.EPError, "handle.send_pos", "3 ranks", "has 2 here"):
        trace(body, x, idx, w)


def test_combine_with_a_larger_max_tokens_is_allowed_and_exact():
    """The rule is T <= cfg.max_tokens_per_rank (plus equal R and C), so this combine is well defined."""
    a = cfg(max_tokens_per_rank=T, recv_capacity=8)
    b = cfg(max_tokens_per_rank=2 * T, recv_capacity=8)
    x, idx, w = inputs()

    def body(x, i, w):
        out = jax_ep.dispatch(x, i, w, a)
        return jnp.stack([jax_ep.combine(out.recv_x, out.handle, c)[0] for c in (a, b)], axis=1)

    y = np.asarray(run(body, x, idx, w), np.float32)
    np.testing.assert_array_equal(y[:, 0], y[:, 1])
    assert np.abs(y[:, 0]).sum() > 0


def test_low_latency_combine_with_another_config_names_both():
    x, idx, w = inputs()
    for other, named in [(cfg(max_tokens_per_rank=2 * T), "max_tokens_per_rank=8"),
                         (cfg(num_experts=2 * E), "num_experts=8")]:
        def body(x, i, w):
            out = jax_ep.low_latency_dispatch(x, i, cfg(), use_fp8=False)
            return jax_ep.low_latency_combine(out.recv_x, i, w, out.handle, other)

        with raises(jax_ep.EPError, "jax_ep.low_latency_combine", "handle.src_info", "max_tokens_per_rank=4",
                    "num_experts=4", named):
            trace(body, x, idx, w)


def test_split_receive_with_another_config_names_the_field_and_both_values():
    x, idx, w = inputs()
    other = cfg(max_tokens_per_rank=2 * T)

    def dispatch_body(x, i):
        return jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, i, cfg(), use_fp8=False),
                                                other).recv_x

    with raises(jax_ep.EPError, "jax_ep.low_latency_dispatch_recv", "max_tokens_per_rank=8 here but 4 at the send"):
        trace(dispatch_body, x, idx)

    def combine_body(x, i, w):
        out = jax_ep.low_latency_dispatch(x, i, cfg(), use_fp8=False)
        pending = jax_ep.low_latency_combine_send(out.recv_x, i, w, out.handle, cfg())
        return jax_ep.low_latency_combine_recv(pending, cfg(num_sms=3))

    with raises(jax_ep.EPError, "jax_ep.low_latency_combine_recv", "num_sms=3 here but 24 at the send"):
        trace(combine_body, x, idx, w)


# ---- unclear errors of the issue --------------------------------------------------------------------------------
def test_topk_weights_none_is_a_clear_error():
    x, idx, w = inputs()
    with raises(jax_ep.EPError, "jax_ep.dispatch", "topk_weights [T, K] f32 is required"):
        trace(lambda x, i: jax_ep.dispatch(x, i, None, cfg()).recv_x, x, idx)
    for op in ("low_latency_combine", "low_latency_combine_send"):
        def body(x, i):
            out = jax_ep.low_latency_dispatch(x, i, cfg(), use_fp8=False)
            res = getattr(jax_ep, op)(out.recv_x, i, None, out.handle, cfg())
            return res if op == "low_latency_combine" else res.buffers[0]

        with raises(jax_ep.EPError, f"jax_ep.{op}", "topk_weights [T, K] f32 is required"):
            trace(body, x, idx)


def test_malformed_pending_is_an_error():
    x, idx, w = inputs()

    def body(make):
        def f(x, i):
            p = jax_ep.low_latency_dispatch_send(x, i, cfg(), use_fp8=False)
            return jax_ep.low_latency_dispatch_recv(make(p), cfg()).recv_x
        return f

    cases = [
        (lambda p: jax_ep.LowLatencyDispatchPending(buffers=(), state=p.state, cfg=p.cfg), "pending is malformed"),
        (lambda p: jax_ep.LowLatencyDispatchPending(buffers=(None,), state=p.state), "pending is malformed"),
        (lambda p: jax_ep.LowLatencyDispatchPending(buffers=p.buffers, state=p.state.value), "pending is malformed"),
        # without the mode its send resolved, an "auto" receive could run the other mode's kernels
        (lambda p: jax_ep.LowLatencyDispatchPending(buffers=p.buffers, state=p.state, use_fp8=False, cfg=p.cfg),
         "pending is malformed"),
        (lambda p: p.buffers, "pending must be the LowLatencyDispatchPending"),
    ]
    for make, message in cases:
        with raises(jax_ep.EPError, "jax_ep.low_latency_dispatch_recv", message):
            trace(body(make), x, idx)


def test_buffer_size_hint_with_zero_ranks():
    with raises(jax_ep.EPError, "jax_ep.buffer_size_hint", "num_ranks must be a positive int"):
        jax_ep.buffer_size_hint(cfg(), 0)


def test_initialize_with_experts_not_divisible_by_ranks():
    with raises(jax_ep.EPError, "jax_ep.initialize", "EPConfig.num_experts (6) must be divisible", "(4)"):
        jax_ep.initialize(ep_mesh(4), cfg(num_experts=6))


# ---- gradients that are not defined ------------------------------------------------------------------------------
@pytest.mark.parametrize("which,named", [
    ("ll_fp8", "jax_ep.low_latency_dispatch(use_fp8=True) is not differentiable"),
    ("normal_fp8", "jax_ep.dispatch: fp8 input"),
    ("dispatch_send", "jax_ep.low_latency_dispatch_send is not differentiable"),
    ("combine_send", "jax_ep.low_latency_combine_send is not differentiable"),
])
def test_grad_through_a_non_differentiable_op_names_it(which, named):
    x, idx, w = inputs()
    c = cfg()

    def body(x, i, w):
        if which == "ll_fp8":
            out = jax_ep.low_latency_dispatch(x, i, c, use_fp8=True)
            return out.recv_x_scales.sum(keepdims=True)[0] + out.recv_x.astype(jnp.float32).sum()
        if which == "normal_fp8":
            scales = jnp.ones((x.shape[0], H // 128), jnp.float32) * w[:, :1]
            out = jax_ep.dispatch(x.astype(jnp.float8_e4m3fn), i, w, c, x_scales=scales)
            return out.recv_x_scales.sum(keepdims=True)[0] + out.recv_topk_weights.sum()
        if which == "dispatch_send":
            out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, i, c, use_fp8=False), c)
            return out.recv_x.astype(jnp.float32).sum(keepdims=True)[0]
        out = jax_ep.low_latency_dispatch(x, i, c, use_fp8=False)
        y = jax_ep.low_latency_combine_recv(jax_ep.low_latency_combine_send(out.recv_x, i, w, out.handle, c), c)
        return y.astype(jnp.float32).sum(keepdims=True)[0]

    def loss(x, w):
        return jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC)(x, idx, w).sum()

    argnums = (1,) if which == "normal_fp8" else (0, 1)
    with raises(jax_ep.EPError, named):  # jit: the error comes while tracing the backward pass, nothing runs
        jax.jit(jax.grad(loss, argnums=argnums)).trace(x.astype(jnp.float32) if which == "normal_fp8" else x, w)


# ---- masked top-k weights --------------------------------------------------------------------------------------------
def test_low_latency_combine_ignores_masked_weights_even_non_finite():
    """-1 and out-of-range slots (E, E + 5, -3) count 0 whatever their weight (NaN, inf), forward and backward."""
    x, idx, w = inputs(seed=3)
    masked = np.zeros(idx.shape, bool)
    masked[::2, 1] = True
    masked[1::4, 0] = True
    bad_ids = np.resize(np.array([-1, E, E + 5, -3], np.int32), idx.shape)
    idx_m = jnp.where(masked, bad_ids, idx)
    w_bad = jnp.where(masked, jnp.resize(jnp.array([jnp.nan, jnp.inf, -jnp.inf], jnp.float32), w.shape), w)
    w_zero = jnp.where(masked, 0.0, w)

    def body(x, i, w):
        out = jax_ep.low_latency_dispatch(x, i, cfg(), use_fp8=False)
        return jax_ep.low_latency_combine(out.recv_x, i, w, out.handle, cfg())

    def loss(x, w):
        y = jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC)(x, idx_m, w)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, y_bad), (dx_bad, dw_bad) = grad(x, w_bad)
    (_, y_zero), (dx_zero, dw_zero) = grad(x, w_zero)
    y_bad = np.asarray(y_bad, np.float32)
    assert np.isfinite(y_bad).all()
    np.testing.assert_array_equal(y_bad, np.asarray(y_zero, np.float32))
    np.testing.assert_array_equal(np.asarray(dx_bad, np.float32), np.asarray(dx_zero, np.float32))
    dw_bad = np.asarray(dw_bad)
    assert np.isfinite(dw_bad).all() and (dw_bad[masked] == 0).all()
    np.testing.assert_array_equal(dw_bad, np.asarray(dw_zero))


# ---- non-finite fp8 blocks ---------------------------------------------------------------------------------------------
def numpy_fp8_rule(x):
    """The rule of docs/API.md in NumPy (tests/oracle.py): (q bytes uint8 [T, H], scales f32 [T, H // 128])."""
    q, scale = O.quantize_fp8(np.asarray(x, np.float32))
    return q.view(np.uint8), scale


def test_fp8_reference_follows_the_non_finite_rule():
    x = non_finite_rows(8, 512, seed=0)
    want_q, want_s = numpy_fp8_rule(x)
    for quantize in (fp8.quantize_blocks, jax.jit(fp8.quantize_blocks)):
        q, s = quantize(jnp.asarray(x, jnp.bfloat16))
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)), want_q)
        np.testing.assert_array_equal(np.asarray(s), want_s)
    # NaN exactly where the input was non-finite; every finite channel finite, its block's scale finite
    deq = np.asarray(fp8.dequantize_blocks(q, s))
    np.testing.assert_array_equal(np.isnan(deq), ~np.isfinite(x))
    assert np.isfinite(np.asarray(s)).all()
    # the finite channels of a block with a non-finite one are quantized as if it were absent
    clean = np.where(np.isfinite(x), x, 0.0).astype(np.float32)
    clean_q, clean_s = numpy_fp8_rule(clean)
    np.testing.assert_array_equal(np.where(np.isfinite(x), want_q, 0), np.where(np.isfinite(x), clean_q, 0))
    np.testing.assert_array_equal(want_s, clean_s)


def test_low_latency_fp8_dispatch_of_non_finite_rows():
    """Through the op: every valid row is the rule applied to its source token's row."""
    h = 256
    x_np = non_finite_rows(R * T, h, seed=1)
    x = jnp.asarray(x_np, jnp.bfloat16)
    _, idx, _ = inputs(h=h, seed=1)
    c = cfg(hidden=h)

    def body(x, i):
        out = jax_ep.low_latency_dispatch(x, i, c, use_fp8=True)
        return (jax.lax.bitcast_convert_type(out.recv_x, jnp.uint8), out.recv_x_scales, out.recv_count,
                out.handle.src_info, out.handle.layout_range)

    q, s, count, src, layout = (np.asarray(a) for a in run(body, x, idx))
    want_q, want_s = numpy_fp8_rule(x_np)
    L = E // R
    q, s = q.reshape(R, L, R * T, h), s.reshape(R, L, R * T, h // 128)
    count, src, layout = count.reshape(R, L), src.reshape(R, L, R * T), layout.reshape(R, L, R)
    checked = 0
    for r in range(R):
        for l_ in range(L):
            row = 0
            for s_rank in range(R):
                for _ in range(layout[r, l_, s_rank]):
                    token = s_rank * T + src[r, l_, row]
                    np.testing.assert_array_equal(q[r, l_, row], want_q[token])
                    np.testing.assert_array_equal(s[r, l_, row], want_s[token])
                    row += 1
                    checked += 1
            assert row == count[r, l_]
    assert checked == int((np.asarray(idx) >= 0).sum())


# ---- tracer leaks (the issue's note: LL ops used to keep a tracer in a thread-local) ---------------------------------
def test_ops_pass_jax_check_tracer_leaks():
    x, idx, w = inputs(seed=4)
    c = cfg()

    def body(x, i, w):
        st = jax_ep.low_latency_state(c)
        pending, st = jax_ep.low_latency_dispatch_send(x, i, c, use_fp8=True, state=st)
        out, st = jax_ep.low_latency_dispatch_recv(pending, c, state=st)
        rows = fp8.dequantize_blocks(out.recv_x, out.recv_x_scales).astype(jnp.bfloat16)
        y, st = jax_ep.low_latency_combine(rows, i, w, out.handle, c, state=st)
        normal = jax_ep.dispatch(x, i, w, c)
        return y + jax_ep.combine(normal.recv_x, normal.handle, c)[0]

    def loss(x, w):
        def f(x, i, w):
            out = jax_ep.low_latency_dispatch(x, i, c, use_fp8=False)
            return jax_ep.low_latency_combine(out.recv_x, i, w, out.handle, c)

        y = jax.shard_map(f, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC)(x, idx, w)
        return y.astype(jnp.float32).sum()

    with jax.checking_leaks():
        y = np.asarray(run(body, x, idx, w), np.float32)
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert np.isfinite(y).all() and np.isfinite(np.asarray(dx, np.float32)).all()


# ---- low-latency modes -----------------------------------------------------------------------------------------------
def test_low_latency_combine_of_a_per_expert_handle_with_a_per_rank_config():
    x, idx, w = inputs()

    def body(x, i, w):
        out = jax_ep.low_latency_dispatch(x, i, cfg(low_latency_mode="per_expert"), use_fp8=False)
        return jax_ep.low_latency_combine(out.recv_x, i, w, out.handle, cfg(low_latency_mode="per_rank"))

    with raises(jax_ep.EPError, "jax_ep.low_latency_combine", "per_rank", "msg_token", "per_expert"):
        trace(body, x, idx, w)


@pytest.mark.parametrize("mode", ["", "per-rank", "PER_RANK", None, 1])
def test_bad_low_latency_mode(mode):
    with raises(jax_ep.EPError, "EPConfig.low_latency_mode", repr(mode)):
        cfg(low_latency_mode=mode)


@pytest.mark.parametrize("num_ranks,topk,expected", [(1, 1, "per_expert"), (2, 1, "per_expert"),
                                                     (2, 2, "per_expert"), (2, 4, "per_rank"),
                                                     (2, 8, "per_rank"), (4, 4, "per_expert"),
                                                     (4, 8, "per_rank"), (8, 8, "per_rank")])
def test_auto_low_latency_mode_follows_the_documented_rule(num_ranks, topk, expected):
    rows = num_ranks * (1 - (1 - 1 / num_ranks) ** topk)  # expected distinct ranks per token, uniform routing
    assert (rows <= 2 / 3 * topk) == (expected == "per_rank")
    for t_max in (1, 63, 64, 256):  # per_rank only for calls of 64 tokens on: below, its fixed steps cost more
        auto = jax_ep.EPConfig(64, H, topk, t_max, low_latency_mode="auto")
        assert jax_ep.EPConfig(64, H, topk, t_max) == auto  # "auto" is the default
        for tokens in sorted({1, 63, 64, t_max} & set(range(1, t_max + 1))):  # the call's T decides, not T_max
            want = expected if tokens >= 64 else "per_expert"
            assert auto.low_latency_mode_for(num_ranks, tokens) == want, (t_max, tokens)
            run = auto.for_low_latency_call(num_ranks, tokens)
            assert run.low_latency_mode == want and dataclasses.replace(run, low_latency_mode="auto") == auto
        assert auto.low_latency_mode_for(num_ranks) == auto.low_latency_mode_for(num_ranks, t_max)  # None: T_max
        for fixed in ("per_expert", "per_rank"):
            c = jax_ep.EPConfig(64, H, topk, t_max, low_latency_mode=fixed)
            assert c.low_latency_mode_for(num_ranks, 1) == fixed and c.for_low_latency_call(num_ranks, 1) is c


# ---- allow_nvlink_for_low_latency (NVSHMEM puts) ---------------------------------------------------------------------
@pytest.mark.parametrize("value", [None, 0, 1, "False"])
def test_bad_allow_nvlink_for_low_latency(value):
    with raises(jax_ep.EPError, "EPConfig.allow_nvlink_for_low_latency", repr(value)):
        cfg(allow_nvlink_for_low_latency=value)


def test_nvshmem_low_latency_is_per_expert_only():
    with raises(jax_ep.EPError, "allow_nvlink_for_low_latency=False", "per_rank"):
        cfg(allow_nvlink_for_low_latency=False, low_latency_mode="per_rank")
    c = jax_ep.EPConfig(64, H, 8, 128, low_latency_mode="auto", allow_nvlink_for_low_latency=False)
    assert c.low_latency_mode_for(8) == "per_expert"  # "auto" would pick per_rank at R=8, K=8 over NVLink
    assert jax_ep.EPConfig(64, H, 8, 128, low_latency_mode="auto").low_latency_mode_for(8) == "per_rank"


def test_nvshmem_low_latency_needs_one_process_per_gpu_and_one_choice_per_axis():
    from jax_ep.runtime import lifecycle

    R8 = {"ep": 8}
    nvshmem = cfg(allow_nvlink_for_low_latency=False, low_latency_buffers=True)
    nvlink = cfg(low_latency_buffers=True)
    lifecycle._check_low_latency_transport([nvshmem], R8, one_process_per_gpu=True)
    lifecycle._check_low_latency_transport([nvlink, cfg(num_sms=8, low_latency_buffers=True)], R8, False)
    with raises(jax_ep.EPError, "allow_nvlink_for_low_latency=False", "one process per GPU", "jax_ep.launch", "'ep'"):
        lifecycle._check_low_latency_transport([nvshmem], R8, one_process_per_gpu=False)
    with raises(jax_ep.EPError, "disagree", "allow_nvlink_for_low_latency", "num_max_nvl_peers"):
        lifecycle._check_low_latency_transport([nvshmem, nvlink], R8, one_process_per_gpu=True)
    # configs without low-latency buffers never run an LL op on the CUDA backend: no constraint
    lifecycle._check_low_latency_transport([nvshmem, cfg(low_latency_buffers=False)], R8, one_process_per_gpu=True)


def test_group_wider_than_nvl_domain_takes_the_nvshmem_low_latency_kernels():
    """R > num_max_nvl_peers: the NVSHMEM kernels, with the same requirements as allow_nvlink_for_low_latency=False
    (one process per GPU, per_expert, one choice per axis), stores inside a domain of num_max_nvl_peers ranks."""
    from jax_ep.runtime import lifecycle

    two_nodes = cfg(num_max_nvl_peers=4, low_latency_buffers=True)
    assert two_nodes.low_latency_over_nvshmem(8) and not two_nodes.low_latency_over_nvshmem(4)
    assert two_nodes.low_latency_nvl_domain() == 4
    assert cfg(num_max_nvl_peers=4, allow_nvlink_for_low_latency=False).low_latency_nvl_domain() == 1
    lifecycle._check_low_latency_transport([two_nodes], {"ep": 4}, one_process_per_gpu=False)  # fits one domain
    lifecycle._check_low_latency_transport([two_nodes], {"ep": 8}, one_process_per_gpu=True)
    with raises(jax_ep.EPError, "R > num_max_nvl_peers", "one process per GPU", "R=8"):
        lifecycle._check_low_latency_transport([two_nodes], {"ep": 8}, one_process_per_gpu=False)
    with raises(jax_ep.EPError, "disagree", "num_max_nvl_peers"):  # both NVSHMEM, other NVLink domains
        lifecycle._check_low_latency_transport([two_nodes, cfg(num_max_nvl_peers=2, low_latency_buffers=True)],
                                               {"ep": 8}, one_process_per_gpu=True)
    with raises(jax_ep.EPError, "per_rank", "no NVSHMEM kernels", "num_max_nvl_peers (4)"):
        lifecycle._check_low_latency_transport([cfg(num_max_nvl_peers=4, low_latency_mode="per_rank",
                                                    low_latency_buffers=True)], {"ep": 8}, one_process_per_gpu=True)
    auto = jax_ep.EPConfig(64, H, 8, 128, low_latency_mode="auto", num_max_nvl_peers=4)
    assert auto.low_latency_mode_for(8) == "per_expert" and auto.low_latency_mode_for(4) == "per_rank"


def test_reference_backend_ignores_allow_nvlink_for_low_latency():
    """Same outputs bit for bit: the field only picks CUDA kernels (the reference is the oracle for both)."""
    x, idx, w = inputs()

    def program(c):
        def body(x, i, w):
            out = jax_ep.low_latency_dispatch(x, i, c, use_fp8=False)
            y = jax_ep.low_latency_combine(out.recv_x, i, w, out.handle, c)
            return out.recv_x, out.recv_count, out.handle.src_info, y
        return [np.asarray(v) for v in run(body, x, idx, w)]

    for a, b in zip(program(cfg()), program(cfg(allow_nvlink_for_low_latency=False))):
        np.testing.assert_array_equal(a, b)
