"""Every error case of SPEC §6 raises at trace time with a message naming the argument."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_ep
from helpers import config_maker, run_sharded

R, E, H, K, TMAX = 2, 4, 128, 2, 4
cfg = config_maker(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=TMAX)
run = functools.partial(run_sharded, num_ranks=R)


def good(t=3, h=H, k=K):
    x = jnp.ones((R * t, h), jnp.bfloat16)
    idx = jnp.zeros((R * t, k), jnp.int32)
    w = jnp.ones((R * t, k), jnp.float32)
    return x, idx, w


def expect(match, fn, *args, exc=jax_ep.EPError, **kw):
    with pytest.raises(exc, match=match):
        run(fn, *args, **kw)


@pytest.mark.parametrize("field,value,match", [
    ("num_experts", 0, "num_experts must be a positive int"),
    ("hidden", -1, "hidden must be a positive int"),
    ("num_topk", 17, r"num_topk must be in \[1, 16\]"),
    ("num_topk", 5, r"num_topk must be <= num_experts"),
    ("max_tokens_per_rank", 1.5, "max_tokens_per_rank must be a positive int"),
    ("recv_capacity", 0, "recv_capacity must be a positive int"),
    ("backend", "nccl", "backend must be one of"),
    ("axis_name", "", "axis_name must be a non-empty str"),
])
def test_config_errors(field, value, match):
    with pytest.raises(jax_ep.EPError, match=match) as e:  # EPError is a ValueError
        cfg(**{field: value})
    assert type(e.value) is jax_ep.EPError


def test_config_is_hashable_and_frozen():
    assert hash(cfg()) == hash(cfg()) and cfg() == cfg()
    with pytest.raises(Exception):
        cfg().hidden = 3


def test_wrong_x_dtype_names_x():
    x, idx, w = good()
    expect(r"x must have dtype bfloat16 or float32 or float8_e4m3fn, got float16",
           lambda x, i, w: jax_ep.dispatch(x, i, w, cfg()).recv_x, x.astype(jnp.float16), idx, w,
           exc=jax_ep.EPTypeError)


def test_wrong_x_rank_and_hidden():
    x, idx, w = good()
    expect(r"x must have rank 2", lambda x, i, w: jax_ep.dispatch(x[:, None], i, w, cfg()).recv_x, x, idx, w)
    x2, _, _ = good(h=2 * H)
    expect(r"x must have shape \[\*, 128\], got \(3, 256\)",
           lambda x, i, w: jax_ep.dispatch(x, i, w, cfg()).recv_x, x2, idx, w)


def test_too_many_tokens_names_max_tokens():
    x, idx, w = good(t=TMAX + 1)
    expect(r"x has 5 tokens per rank; expected 1 <= T <= cfg.max_tokens_per_rank \(4\)",
           lambda x, i, w: jax_ep.dispatch(x, i, w, cfg()).recv_x, x, idx, w)


def test_topk_errors():
    x, idx, w = good()
    expect(r"topk_idx must have dtype int32, got float32",
           lambda x, i, w: jax_ep.dispatch(x, i.astype(jnp.float32), w, cfg()).recv_x, x, idx, w,
           exc=jax_ep.EPTypeError)
    expect(r"topk_idx must have shape \[3, 2\], got \(3, 1\)",
           lambda x, i, w: jax_ep.dispatch(x, i[:, :1], w, cfg()).recv_x, x, idx, w)
    expect(r"topk_weights must have dtype float32, got bfloat16",
           lambda x, i, w: jax_ep.dispatch(x, i, w.astype(jnp.bfloat16), cfg()).recv_x, x, idx, w,
           exc=jax_ep.EPTypeError)


def test_experts_not_divisible_by_ranks():
    x, idx, w = good()
    expect(r"num_experts \(6\) must be divisible by the size of mesh axis 'ep' \(4\)",
           lambda x, i, w: jax_ep.dispatch(x, i, w, cfg(num_experts=6)).recv_x,
           jnp.ones((4 * 3, H), jnp.bfloat16), jnp.zeros((12, K), jnp.int32), jnp.ones((12, K)), num_ranks=4)


def test_fp8_needs_scales_and_hidden_multiple_of_128():
    x, idx, w = good()
    x8 = x.astype(jnp.float8_e4m3fn)
    expect(r"x_scales \[T, H//128\] f32 is required", lambda x, i, w: jax_ep.dispatch(x, i, w, cfg()).recv_x,
           x8, idx, w)
    expect(r"x_scales must be None when x is bfloat16",
           lambda x, i, w: jax_ep.dispatch(x, i, w, cfg(), x_scales=jnp.ones((3, 1))).recv_x, x, idx, w)
    x_odd = jnp.ones((R * 3, 96), jnp.float8_e4m3fn)
    expect(r"fp8 needs cfg.hidden to be a multiple of 128, got 96",
           lambda x, i, w: jax_ep.dispatch(x, i, w, cfg(hidden=96), x_scales=jnp.ones((3, 0))).recv_x,
           x_odd, idx, w)
    xb = jnp.ones((R * 3, 96), jnp.bfloat16)
    expect(r"fp8 needs cfg.hidden to be a multiple of 128, got 96",
           lambda x, i: jax_ep.low_latency_dispatch(x, i, cfg(hidden=96), use_fp8=True).recv_x, xb, idx)


def test_outside_shard_map_names_axis():
    x, idx, w = good()
    with pytest.raises(jax_ep.EPError, match=r"inside jax.shard_map over mesh axis cfg.axis_name='ep'"):
        jax.jit(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg()).recv_x)(x, idx, w)
    with pytest.raises(jax_ep.EPError, match=r"cfg.axis_name='experts'"):
        run(lambda x, i, w: jax_ep.dispatch(x, i, w, cfg(axis_name="experts")).recv_x, x, idx, w)


def test_combine_shape_and_handle_errors():
    x, idx, w = good()
    c = cfg()

    def wrong_rows(x, i, w):
        out = jax_ep.dispatch(x, i, w, c)
        return jax_ep.combine(out.recv_x[:-1], out.handle, c)[0]

    expect(r"expert_out must have shape \[8, 128\], got \(7, 128\)", wrong_rows, x, idx, w)

    def not_a_handle(x, i, w):
        out = jax_ep.dispatch(x, i, w, c)
        return jax_ep.combine(out.recv_x, tuple(out.handle), c)[0]

    expect(r"handle must be a DispatchHandle", not_a_handle, x, idx, w)

    def wrong_weights(x, i, w):
        out = jax_ep.dispatch(x, i, w, c)
        return jax_ep.combine(out.recv_x, out.handle, c, topk_weights=w)[0]

    expect(r"topk_weights must have shape \[8, 2\], got \(3, 2\)", wrong_weights, x, idx, w)


def test_low_latency_errors():
    x, idx, w = good()
    c = cfg()
    expect(r"x must have dtype bfloat16, got float8_e4m3fn",
           lambda x, i: jax_ep.low_latency_dispatch(x.astype(jnp.float8_e4m3fn), i, c).recv_x, x, idx,
           exc=jax_ep.EPTypeError)

    def wrong_expert_out(x, i, w):
        ll = jax_ep.low_latency_dispatch(x, i, c, use_fp8=False)
        return jax_ep.low_latency_combine(ll.recv_x[:, :-1], i, w, ll.handle, c)

    expect(r"expert_out must have shape \[2, 8, 128\], got \(2, 7, 128\)", wrong_expert_out, x, idx, w)

    def wrong_pending(x, i):
        return jax_ep.low_latency_dispatch_recv((x,), c).recv_x

    expect(r"pending must be the LowLatencyDispatchPending", wrong_pending, x, idx)


def test_out_of_range_ids_are_no_expert():
    """Ids outside [-1, E) behave exactly like -1: no crash, nothing sent for them."""
    x, idx, w = good()
    bad = jnp.asarray(np.array([[E, -7], [E + 3, 1], [0, 2 ** 30]] * R, np.int32))
    clean = jnp.where((bad >= 0) & (bad < E), bad, -1)
    f = lambda x, i, w: jax_ep.dispatch(x, i, w, cfg()).recv_topk_idx
    np.testing.assert_array_equal(run(f, x, bad, w), run(f, x, clean, w))
