"""The CUDA backend: the Backend protocol (base.py) implemented with the native FFI targets.

Called by the ops modules inside `shard_map` over `cfg.axis_name`, after validation, with `num_ranks` = R static.
Nothing here knows where buffers live: the attributes carry the config and the axis name (_ffi.normal_attrs /
low_latency_attrs) and every device's handler resolves its group, rank and staging from the axis binding that
jax_ep.initialize made. So a compiled or exported program outlives a later initialize.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..config import EPConfig
from ..types import (DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyDispatchOutput, LowLatencyHandle,
                      LowLatencyState)
from ..low_latency_chain import initial
from . import _ffi, reference

BF16 = jnp.bfloat16
F32 = jnp.float32
I32 = jnp.int32


def _none_like(rows):
    """A [N, 0] f32 operand standing for "no weights / no scales" (keeps `rows`' varying axes)."""
    return rows[:, :0].astype(F32)


def layout(topk_idx, cfg: EPConfig, num_ranks: int) -> DispatchLayout:
    ntr, nte, itr = _ffi.layout(topk_idx.astype(I32), num_experts=cfg.num_experts, num_ranks=num_ranks)
    return DispatchLayout(num_tokens_per_rank=ntr, num_tokens_per_expert=nte, is_token_in_rank=itr)


def dispatch(x, x_scales, topk_idx, topk_weights, cfg: EPConfig, num_ranks: int) -> DispatchOutput:
    fp8 = x_scales is not None
    scales = x_scales.astype(F32) if fp8 else _none_like(topk_weights.astype(F32))
    (recv_x, recv_scales, recv_idx, recv_w, n_recv, n_per_expert, send_pos, src_idx, src_rank, rank_counts,
     row_offset) = _ffi.dispatch(
        x, scales, topk_idx.astype(I32), topk_weights.astype(F32), num_ranks=num_ranks,
        capacity=cfg.capacity(num_ranks), num_local_experts=cfg.num_local_experts(num_ranks),
        attrs=_ffi.normal_attrs(cfg, num_ranks))
    handle = DispatchHandle(send_pos=send_pos, recv_src_idx=src_idx, recv_src_rank=src_rank,
                            recv_rank_counts=rank_counts, send_row_offset=row_offset)
    return DispatchOutput(recv_x=recv_x, recv_x_scales=recv_scales if fp8 else None, recv_topk_idx=recv_idx,
                          recv_topk_weights=recv_w, num_recv_tokens=n_recv, num_recv_tokens_per_expert=n_per_expert,
                          handle=handle)


def cached_dispatch(payload, weights, handle: DispatchHandle, cfg: EPConfig, num_ranks: int):
    w = weights.astype(F32) if weights is not None else _none_like(payload)
    recv, recv_w = _ffi.cached_dispatch(payload, w, *handle, attrs=_ffi.normal_attrs(cfg, num_ranks))
    return recv, (recv_w if weights is not None else None)


def combine(values, weights, handle: DispatchHandle, cfg: EPConfig, num_ranks: int):
    w = weights.astype(F32) if weights is not None else _none_like(values)
    y, y_w = _ffi.combine(values, w, *handle, attrs=_ffi.normal_attrs(cfg, num_ranks))
    return y, (y_w if weights is not None else None)


# ---- low-latency mode: every op threads the state (low_latency_chain.py); the kernels apply the same rules ------
def _dispatch_output(results, use_fp8: bool, per_rank: bool):
    recv_x, scales, count, src_info, layout_range, msg_token, token_rows, state = results
    handle = LowLatencyHandle(src_info=src_info, layout_range=layout_range,
                              msg_token=msg_token if per_rank else None, token_rows=token_rows if per_rank else None)
    out = LowLatencyDispatchOutput(recv_x=recv_x, recv_x_scales=scales if use_fp8 else None, recv_count=count,
                                   handle=handle)
    return out, LowLatencyState(state)


def _per_rank(cfg: EPConfig, num_ranks: int) -> bool:
    return cfg.low_latency_mode_for(num_ranks) == "per_rank"


def _tables(handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    """The handle's per_rank tables, or the empty [R, 0] / [R, 0, K] operands of per_expert mode."""
    if _per_rank(cfg, num_ranks):
        return handle.msg_token, handle.token_rows
    return (jnp.zeros((num_ranks, 0), I32), jnp.zeros((num_ranks, 0, cfg.num_topk), I32))


def low_latency_dispatch(x, topk_idx, state: LowLatencyState, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    results = _ffi.low_latency_dispatch(x, topk_idx.astype(I32), state.value, num_ranks=num_ranks,
                               num_local_experts=cfg.num_local_experts(num_ranks),
                               attrs=_ffi.low_latency_attrs(cfg, num_ranks, use_fp8))
    return _dispatch_output(results, use_fp8, _per_rank(cfg, num_ranks))


def low_latency_dispatch_send(x, topk_idx, state: LowLatencyState, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    """-> ((token,), next state)."""
    token, st = _ffi.low_latency_dispatch_send(x, topk_idx.astype(I32), state.value,
                                      attrs=_ffi.low_latency_attrs(cfg, num_ranks, use_fp8))
    return (token,), LowLatencyState(st)


def low_latency_dispatch_recv(buffers, state: LowLatencyState, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    (token,) = buffers
    results = _ffi.low_latency_dispatch_recv(token, state.value, num_ranks=num_ranks,
                                    num_local_experts=cfg.num_local_experts(num_ranks),
                                    attrs=_ffi.low_latency_attrs(cfg, num_ranks, use_fp8))
    return _dispatch_output(results, use_fp8, _per_rank(cfg, num_ranks))


def low_latency_combine(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, state: LowLatencyState, cfg: EPConfig,
               num_ranks: int):
    y, st = _ffi.low_latency_combine(expert_out, handle.src_info, handle.layout_range, *_tables(handle, cfg, num_ranks),
                            topk_idx.astype(I32), topk_weights.astype(F32), state.value,
                            attrs=_ffi.low_latency_attrs(cfg, num_ranks))
    return y, LowLatencyState(st)


def low_latency_combine_send(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, state: LowLatencyState,
                    cfg: EPConfig, num_ranks: int):
    """-> ((token, topk_idx, topk_weights), next state): the receive needs the routing again."""
    token, st = _ffi.low_latency_combine_send(expert_out, handle.src_info, handle.layout_range,
                                     *_tables(handle, cfg, num_ranks), topk_weights.astype(F32), state.value,
                                     attrs=_ffi.low_latency_attrs(cfg, num_ranks))
    return (token, topk_idx.astype(I32), topk_weights.astype(F32)), LowLatencyState(st)


def low_latency_combine_recv(buffers, state: LowLatencyState, cfg: EPConfig, num_ranks: int):
    token, topk_idx, topk_weights = buffers
    y, st = _ffi.low_latency_combine_recv(token, topk_idx, topk_weights, state.value,
                                 attrs=_ffi.low_latency_attrs(cfg, num_ranks))
    return y, LowLatencyState(st)


def low_latency_dispatch_transpose(cot_rows, topk_idx, handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    """d x of bf16 LL dispatch = an LL combine of the row cotangents with weight 1 on the first k naming each
    distinct expert (a token sent once to an expert gets that row's cotangent once). A fused op: its own state."""
    idx = reference.sanitize_topk(topk_idx, cfg.num_experts)
    K = idx.shape[1]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # earlier[k, j]: j < k
    repeated = jnp.any((idx[:, :, None] == idx[:, None, :]) & earlier[None], axis=2)
    weights = ((idx >= 0) & ~repeated).astype(F32)
    y, _ = low_latency_combine(cot_rows.astype(BF16), idx, weights, handle, initial(), cfg, num_ranks)
    return y


def low_latency_combine_transpose(dy, expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, cfg: EPConfig,
                         num_ranks: int):
    """(d expert_out, d topk_weights) of LL combine. NOTE: moves data with the reference backend's XLA collectives
    (no dedicated kernel yet); results are the reference's exactly."""
    return reference.low_latency_combine_transpose(dy, expert_out, topk_idx, topk_weights, handle, cfg, num_ranks)
