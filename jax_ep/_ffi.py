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

from . import _native
from .config import FP8_BLOCK


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


def _call(target, result_types, *operands, **attrs):
    _native.ensure_registered()
    return jax.ffi.ffi_call(target, result_types, vmap_method="sequential")(*operands, **attrs)


# ---- jax_ep_layout_v1 ----------------------------------------------------------------------------------------
def layout(topk_idx, *, num_experts: int, num_ranks: int):
    """-> (num_tokens_per_rank [R] i32, num_tokens_per_expert [E] i32, is_token_in_rank [T, R] bool)."""
    T = topk_idx.shape[0]
    types = (
        result_type(topk_idx, (num_ranks,), jnp.int32),
        result_type(topk_idx, (num_experts,), jnp.int32),
        result_type(topk_idx, (T, num_ranks), jnp.bool_),
    )
    return _call("jax_ep_layout_v1", types, topk_idx, num_experts=np.int32(num_experts), num_ranks=np.int32(num_ranks))


# ---- intranode normal mode (CUDA only) ---------------------------------------------------------------------------
def _varying_axes(x):
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(jax.typeof(x), "vma", frozenset()))


def match_varying(*xs):
    """Gives every operand the union of the operands' varying manual axes (ffi_call requires them equal)."""
    axes = frozenset().union(*(_varying_axes(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(axes - _varying_axes(x)))
        if missing:
            pcast = getattr(jax.lax, "pcast", None)
            x = pcast(x, missing, to="varying") if pcast is not None else jax.lax.pvary(x, missing)
        out.append(x)
    return out


def _config_attrs(group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns):
    """The group and EPConfig attributes every intranode and low-latency target decodes (exact widths)."""
    return dict(group_id=np.int64(group_id), num_experts=np.int32(num_experts), hidden=np.int32(hidden),
                num_topk=np.int32(num_topk), max_tokens_per_rank=np.int32(max_tokens_per_rank),
                timeout_ns=np.int64(timeout_ns))


def group_attrs(*, group_id, num_experts, hidden, num_topk, max_tokens_per_rank, num_sms, timeout_ns):
    """The attributes every intranode target decodes (see xla_ffi/intranode.cc)."""
    return dict(_config_attrs(group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns),
                num_sms=np.int32(num_sms))


def dispatch(x, x_scales, topk_idx, topk_weights, *, num_ranks, capacity, num_local_experts, attrs):
    """jax_ep_dispatch_v1. x_scales [T, S] f32 (S = 0 for bf16). Returns the 11 results in binding order:
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
    return _call("jax_ep_dispatch_v1", types, x, x_scales, topk_idx, topk_weights, **attrs)


def cached_dispatch(payload, weights, send_pos, recv_src_idx, recv_src_rank, recv_rank_counts, send_row_offset,
                    *, attrs):
    """jax_ep_cached_dispatch_v1. weights [T, Kw] f32 (Kw = 0: none). -> (recv [C, W], recv_weights [C, Kw])."""
    ops = match_varying(payload, weights, send_pos, recv_src_idx, recv_src_rank, recv_rank_counts, send_row_offset)
    payload, weights = ops[0], ops[1]
    C = recv_src_idx.shape[0]
    types = (result_type(payload, (C, payload.shape[1]), payload.dtype),
             result_type(payload, (C, weights.shape[1]), jnp.float32))
    return _call("jax_ep_cached_dispatch_v1", types, *ops, **attrs)


def combine(values, weights, send_pos, recv_src_idx, recv_src_rank, recv_rank_counts, send_row_offset, *, attrs):
    """jax_ep_combine_v1. weights [C, Kw] f32 (Kw = 0: none). -> (y [T, W], y_weights [T, Kw])."""
    ops = match_varying(values, weights, send_pos, recv_src_idx, recv_src_rank, recv_rank_counts, send_row_offset)
    values, weights = ops[0], ops[1]
    T = send_pos.shape[0]
    types = (result_type(values, (T, values.shape[1]), values.dtype),
             result_type(values, (T, weights.shape[1]), jnp.float32))
    return _call("jax_ep_combine_v1", types, *ops, **attrs)


# ---- low-latency mode (CUDA only) --------------------------------------------------------------------------------
def ll_attrs(*, group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns, ll_offset, ll_bytes):
    """The attributes every low-latency target decodes (see xla_ffi/low_latency.cc)."""
    return dict(_config_attrs(group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns),
                ll_offset=np.int64(ll_offset), ll_bytes=np.int64(ll_bytes))


def ll_dispatch_send(x, topk_idx, *, use_fp8: bool, attrs):
    """jax_ep_ll_dispatch_send_v1 -> token [2] i32 (epoch, T): the receive half's input."""
    x, topk_idx = match_varying(x, topk_idx)
    return _call("jax_ep_ll_dispatch_send_v1", result_type(x, (2,), jnp.int32), x, topk_idx,
                 use_fp8=np.int32(use_fp8), **attrs)


def ll_dispatch_recv(token, *, num_ranks, num_local_experts, use_fp8: bool, attrs):
    """jax_ep_ll_dispatch_recv_v1 -> (recv_x, recv_x_scales [L, rows, S], recv_count, src_info, layout_range)."""
    L, R = num_local_experts, num_ranks
    H = int(attrs["hidden"])
    rows = R * int(attrs["max_tokens_per_rank"])
    S = H // FP8_BLOCK if use_fp8 else 0
    types = (
        result_type(token, (L, rows, H), jnp.float8_e4m3fn if use_fp8 else jnp.bfloat16),
        result_type(token, (L, rows, S), jnp.float32),
        result_type(token, (L,), jnp.int32),
        result_type(token, (L, rows), jnp.int32),
        result_type(token, (L, R), jnp.int32),
    )
    return _call("jax_ep_ll_dispatch_recv_v1", types, token, use_fp8=np.int32(use_fp8), **attrs)


def ll_combine_send(expert_out, src_info, layout_range, *, attrs):
    """jax_ep_ll_combine_send_v1 -> token [2] i32."""
    ops = match_varying(expert_out, src_info, layout_range)
    return _call("jax_ep_ll_combine_send_v1", result_type(ops[0], (2,), jnp.int32), *ops, **attrs)


def ll_combine_recv(token, topk_idx, topk_weights, *, attrs):
    """jax_ep_ll_combine_recv_v1 -> y [T, H] bf16."""
    token, topk_idx, topk_weights = match_varying(token, topk_idx, topk_weights)
    T, H = topk_idx.shape[0], int(attrs["hidden"])
    return _call("jax_ep_ll_combine_recv_v1", result_type(token, (T, H), jnp.bfloat16), token, topk_idx,
                 topk_weights, **attrs)
