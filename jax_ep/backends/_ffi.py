"""Thin `jax.ffi.ffi_call` wrappers: one function per native FFI target, nothing else.

Each wrapper takes arrays and static Python values, turns the values into numpy-typed attributes (the C++ side
decodes exact widths: i32 vs i64 mismatches fail only at execution time), and builds result types from
`jax.typeof(operand)` so results keep the operands' varying-manual-axes type inside `shard_map` (a plain
ShapeDtypeStruct would come out replicated and break custom_vjp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _native
from ..config import FP8_BLOCK


def result_type(like, shape, dtype):
    """Abstract value with `like`'s varying manual axes, and the given shape and dtype."""
    aval = jax.typeof(like)
    shape = tuple(int(s) for s in shape)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None and len(spec) != len(shape):
        # Keep the mesh (manual axes) but give the spec the result's rank: replicated in every local dimension.
        sharding = sharding.update(spec=jax.sharding.PartitionSpec(*([None] * len(shape))))
        return aval.update(shape=shape, dtype=jnp.dtype(dtype), sharding=sharding)
    return aval.update(shape=shape, dtype=jnp.dtype(dtype))


def _call(op, result_types, *operands, has_side_effect=False, input_output_aliases=None, **attrs):
    """One ffi_call of the native target registered for `op` (its versioned name comes from the native module's one
    list, _native.target_name)."""
    _native.ensure_registered()
    return jax.ffi.ffi_call(_native.target_name(op), result_types, has_side_effect=has_side_effect,
                            input_output_aliases=input_output_aliases)(*operands, **attrs)


# ---- attributes: one builder; the native side decodes them as one struct per mode (xla_ffi/attrs.h) --------------
def normal_attrs(cfg, num_ranks: int) -> dict:
    """NormalAttrs: what the normal-mode targets decode. They say *what* (config, axis), never *where*: each
    device's handler resolves its group and buffers from the axis binding made by jax_ep.initialize. nvshmem: the
    NVSHMEM kernels, cfg.normal_over_nvshmem(R); nvl_domain: num_max_nvl_peers, the ranks they reach by stores."""
    return dict(axis=str(cfg.axis_name), num_experts=np.int32(cfg.num_experts), hidden=np.int32(cfg.hidden),
                num_topk=np.int32(cfg.num_topk), max_tokens_per_rank=np.int32(cfg.max_tokens_per_rank),
                num_sms=np.int32(cfg.num_sms), timeout_ns=np.int64(int(cfg.timeout_seconds * 1e9)),
                nvshmem=np.int32(cfg.normal_over_nvshmem(num_ranks)), nvl_domain=np.int32(cfg.num_max_nvl_peers))


def low_latency_attrs(cfg, num_ranks: int, use_fp8: bool = False) -> dict:
    """LowLatencyAttrs: what every low-latency target decodes (use_fp8 is ignored by the combine targets; per_rank:
    cfg.low_latency_mode_for(R); nvshmem: the NVSHMEM kernels, cfg.low_latency_over_nvshmem(R); nvl_domain:
    cfg.low_latency_nvl_domain(), the ranks those kernels reach by stores)."""
    return dict(axis=str(cfg.axis_name), num_experts=np.int32(cfg.num_experts), hidden=np.int32(cfg.hidden),
                num_topk=np.int32(cfg.num_topk), max_tokens_per_rank=np.int32(cfg.max_tokens_per_rank),
                timeout_ns=np.int64(int(cfg.timeout_seconds * 1e9)), use_fp8=np.int32(bool(use_fp8)),
                per_rank=np.int32(cfg.low_latency_mode_for(num_ranks) == "per_rank"),
                nvshmem=np.int32(cfg.low_latency_over_nvshmem(num_ranks)),
                nvl_domain=np.int32(cfg.low_latency_nvl_domain()))


# ---- layout ----------------------------------------------------------------------------------------
def layout(topk_idx, *, num_experts: int, num_ranks: int):
    """-> (num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32, is_token_in_rank [T, R] bool)."""
    T = topk_idx.shape[0]
    types = (
        result_type(topk_idx, (num_ranks,), jnp.int32),
        result_type(topk_idx, (num_experts,), jnp.int32),
        result_type(topk_idx, (T, num_ranks), jnp.bool_),
    )
    return _call("layout", types, topk_idx, num_experts=np.int32(num_experts), num_ranks=np.int32(num_ranks))


# ---- intranode normal mode (CUDA only) ---------------------------------------------------------------------------
def _varying_axes(x):
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def match_varying(*xs):
    """Gives every operand the union of the operands' varying manual axes (ffi_call requires them equal)."""
    axes = frozenset().union(*(_varying_axes(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - _varying_axes(x)))
        if missing:
            x = jax.lax.pcast(x, missing, to="varying")
        out.append(x)
    return out


def dispatch(x, x_scales, topk_idx, topk_weights, *, num_ranks, capacity, num_local_experts, attrs):
    """dispatch. x_scales [T, S] f32 (S = 0 for bf16). Returns the 11 results in binding order:
    recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens, num_recv_tokens_per_expert,
    send_pos, recv_src_idx, recv_src_rank, recv_rank_counts, send_row_offset."""
    x, x_scales, topk_idx, topk_weights = match_varying(x, x_scales, topk_idx, topk_weights)
    T, H = x.shape
    K = topk_idx.shape[1]
    S = x_scales.shape[1]
    C, R, L = capacity, num_ranks, num_local_experts
    i32, f32 = jnp.int32, jnp.float32
    types = (
        result_type(x, (C, H), x.dtype),
        result_type(x, (C, S), f32),
        result_type(x, (C, K), i32),
        result_type(x, (C, K), f32),
        result_type(x, (), i32),
        result_type(x, (L,), i32),
        result_type(x, (T, R), i32),
        result_type(x, (C,), i32),
        result_type(x, (C,), i32),
        result_type(x, (R,), i32),
        result_type(x, (R,), i32),
    )
    return _call("dispatch", types, x, x_scales, topk_idx, topk_weights, **attrs)


def _move_rows(target, rows, weights, handle, out_rows, attrs):
    """The two targets that move rows along a dispatch handle (send_pos, recv_src_idx, recv_src_rank,
    recv_rank_counts, send_row_offset): rows [N, W] and weights [N, Kw] f32 (Kw = 0: none) -> [out_rows, W] rows of
    rows' dtype and [out_rows, Kw] f32."""
    ops = match_varying(rows, weights, *handle)
    rows, weights = ops[0], ops[1]
    types = (result_type(rows, (out_rows, rows.shape[1]), rows.dtype),
             result_type(rows, (out_rows, weights.shape[1]), jnp.float32))
    return _call(target, types, *ops, **attrs)


def cached_dispatch(payload, weights, *handle, attrs):
    """cached_dispatch: payload [T, W] and weights [T, Kw] to the receivers -> ([C, W], [C, Kw])."""
    return _move_rows("cached_dispatch", payload, weights, handle, handle[1].shape[0], attrs)


def combine(values, weights, *handle, attrs):
    """combine: values [C, W] and weights [C, Kw] back to the sources, summed -> ([T, W], [T, Kw])."""
    return _move_rows("combine", values, weights, handle, handle[0].shape[0], attrs)


# ---- low-latency mode (CUDA only) --------------------------------------------------------------------------------
# Every LL target takes the state [4] s32 as its last operand and returns the next state as its last result, aliased
# (in place).
# has_side_effect only on the split phases: it keeps XLA from dropping a split receive whose results look unused
# (its send would stay in flight on the device) or moving a split send away from its receive. A fused op is a pure
# function of its operands (send and receive in one call, nothing left in flight): XLA may drop, merge or hoist it
# like any other op, and it must not carry an effect: JAX runs a program with an effect through its Python dispatch
# path on every call (no C++ fast path: hundreds of microseconds of host time per decode step).
I32 = jnp.int32


def _low_latency_call(op, result_types, *operands, attrs, split: bool):
    n = len(operands)
    return _call(op, result_types, *operands, has_side_effect=split,
                 input_output_aliases={n - 1: len(result_types) - 1}, **attrs)


def table_rows(attrs) -> int:
    """M: rows of the handle's per_rank tables (msg_token [R, M], token_rows [R, M, K]); 0 in per_expert mode."""
    return int(attrs["max_tokens_per_rank"]) if int(attrs["per_rank"]) else 0


def _dispatch_result_types(like, *, num_ranks, num_local_experts, attrs):
    L, R = num_local_experts, num_ranks
    H = int(attrs["hidden"])
    rows = R * int(attrs["max_tokens_per_rank"])
    use_fp8 = bool(attrs["use_fp8"])
    S = H // FP8_BLOCK if use_fp8 else 0
    M = table_rows(attrs)
    return (
        result_type(like, (L, rows, H), jnp.float8_e4m3fn if use_fp8 else jnp.bfloat16),
        result_type(like, (L, rows, S), jnp.float32),
        result_type(like, (L,), I32),
        result_type(like, (L, rows), I32),
        result_type(like, (L, R), I32),
        result_type(like, (R, M), I32),
        result_type(like, (R, M, int(attrs["num_topk"])), I32),
        result_type(like, (4,), I32),
    )


def low_latency_dispatch(x, topk_idx, state, *, num_ranks, num_local_experts, attrs):
    """low_latency_dispatch (send + receive in one call) -> (recv_x, recv_x_scales [L, rows, S], recv_count,
    src_info, layout_range, msg_token [R, M], token_rows [R, M, K], state)."""
    x, topk_idx, state = match_varying(x, topk_idx, state)
    types = _dispatch_result_types(x, num_ranks=num_ranks, num_local_experts=num_local_experts, attrs=attrs)
    return _low_latency_call("low_latency_dispatch", types, x, topk_idx, state, attrs=attrs, split=False)


def low_latency_dispatch_send(x, topk_idx, state, *, attrs):
    """low_latency_dispatch_send -> (token [4], state)."""
    x, topk_idx, state = match_varying(x, topk_idx, state)
    types = (result_type(x, (4,), I32), result_type(x, (4,), I32))
    return _low_latency_call("low_latency_dispatch_send", types, x, topk_idx, state, attrs=attrs, split=True)


def low_latency_dispatch_recv(token, state, *, num_ranks, num_local_experts, attrs):
    """low_latency_dispatch_recv -> (recv_x, recv_x_scales, recv_count, src_info, layout_range, msg_token,
    token_rows, state)."""
    token, state = match_varying(token, state)
    types = _dispatch_result_types(token, num_ranks=num_ranks, num_local_experts=num_local_experts, attrs=attrs)
    return _low_latency_call("low_latency_dispatch_recv", types, token, state, attrs=attrs, split=True)


def low_latency_combine(expert_out, src_info, layout_range, msg_token, token_rows, topk_idx, topk_weights, state, *, attrs):
    """low_latency_combine (send + receive in one call) -> (y [T, H] bf16, state)."""
    ops = match_varying(expert_out, src_info, layout_range, msg_token, token_rows, topk_idx, topk_weights, state)
    T, H = topk_idx.shape[0], int(attrs["hidden"])
    types = (result_type(ops[0], (T, H), jnp.bfloat16), result_type(ops[0], (4,), I32))
    return _low_latency_call("low_latency_combine", types, *ops, attrs=attrs, split=False)


def low_latency_combine_send(expert_out, src_info, layout_range, msg_token, token_rows, topk_weights, state, *, attrs):
    """low_latency_combine_send -> (token [4], state). topk_weights: pushed to the expert ranks (per_rank)."""
    ops = match_varying(expert_out, src_info, layout_range, msg_token, token_rows, topk_weights, state)
    types = (result_type(ops[0], (4,), I32), result_type(ops[0], (4,), I32))
    return _low_latency_call("low_latency_combine_send", types, *ops, attrs=attrs, split=True)


def low_latency_combine_recv(token, topk_idx, topk_weights, state, *, attrs):
    """low_latency_combine_recv -> (y [T, H] bf16, state)."""
    ops = match_varying(token, topk_idx, topk_weights, state)
    T, H = topk_idx.shape[0], int(attrs["hidden"])
    types = (result_type(ops[0], (T, H), jnp.bfloat16), result_type(ops[0], (4,), I32))
    return _low_latency_call("low_latency_combine_recv", types, *ops, attrs=attrs, split=True)
