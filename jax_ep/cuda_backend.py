"""The CUDA backend: the backend interface of docs/API.md implemented with the native FFI targets.

Called by jax_ep/ops.py inside `shard_map` over `cfg.axis_name`, after validation, with `num_ranks` = R static.
The group (staging buffers and peer pointers: CUDA peer access with one process, NVSHMEM symmetric buffers with one
process per GPU) comes from `jax_ep.runtime.group_id_for(cfg)`; each device's handler finds its own group and rank
from that id and its device ordinal. Low-latency ops also get the runtime's low-latency region (offset, bytes).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _ffi, reference
from .config import EPConfig
from .handle import (DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyDispatchOutput,
                     LowLatencyHandle)
from .validation import EPError

BF16 = jnp.bfloat16
F32 = jnp.float32
I32 = jnp.int32
FP8 = jnp.float8_e4m3fn


def _attrs(cfg: EPConfig):
    from . import runtime

    return _ffi.group_attrs(
        group_id=runtime.group_id_for(cfg), num_experts=cfg.num_experts, hidden=cfg.hidden, num_topk=cfg.num_topk,
        max_tokens_per_rank=cfg.max_tokens_per_rank, num_sms=cfg.num_sms,
        timeout_ns=int(cfg.timeout_seconds * 1e9))


def _none_like(rows):
    """A [N, 0] f32 operand standing for "no weights / no scales" (keeps `rows`' varying axes)."""
    return rows[:, :0].astype(F32)


def layout(topk_idx, cfg: EPConfig, num_ranks: int) -> DispatchLayout:
    ntr, nte, itr = _ffi.layout(topk_idx.astype(jnp.int32), num_experts=cfg.num_experts, num_ranks=num_ranks)
    return DispatchLayout(num_tokens_per_rank=ntr, num_tokens_per_expert=nte, is_token_in_rank=itr)


def dispatch(x, x_scales, topk_idx, topk_weights, cfg: EPConfig, num_ranks: int) -> DispatchOutput:
    fp8 = x_scales is not None
    scales = x_scales.astype(F32) if fp8 else _none_like(topk_weights.astype(F32))
    (recv_x, recv_scales, recv_idx, recv_w, n_recv, n_per_expert, send_pos, src_idx, src_rank, rank_counts,
     row_offset) = _ffi.dispatch(
        x, scales, topk_idx.astype(jnp.int32), topk_weights.astype(F32), num_ranks=num_ranks,
        capacity=cfg.capacity(num_ranks), num_local_experts=cfg.num_local_experts(num_ranks), attrs=_attrs(cfg))
    handle = DispatchHandle(send_pos=send_pos, recv_src_idx=src_idx, recv_src_rank=src_rank,
                            recv_rank_counts=rank_counts, send_row_offset=row_offset)
    return DispatchOutput(recv_x=recv_x, recv_x_scales=recv_scales if fp8 else None, recv_topk_idx=recv_idx,
                          recv_topk_weights=recv_w, num_recv_tokens=n_recv, num_recv_tokens_per_expert=n_per_expert,
                          handle=handle)


def cached_dispatch(payload, weights, handle: DispatchHandle, cfg: EPConfig, num_ranks: int):
    w = weights.astype(F32) if weights is not None else _none_like(payload)
    recv, recv_w = _ffi.cached_dispatch(payload, w, *handle, attrs=_attrs(cfg))
    return recv, (recv_w if weights is not None else None)


def combine(values, weights, handle: DispatchHandle, cfg: EPConfig, num_ranks: int):
    w = weights.astype(F32) if weights is not None else _none_like(values)
    y, y_w = _ffi.combine(values, w, *handle, attrs=_attrs(cfg))
    return y, (y_w if weights is not None else None)


# ---- low-latency mode ---------------------------------------------------------------------------------------------
def low_latency_region(cfg: EPConfig) -> tuple[int, int]:
    """(byte offset, bytes) of the low-latency region in every rank's staging buffer, as the runtime planned it."""
    from . import runtime

    rt = runtime.runtime_for(cfg)
    if rt.low_latency_bytes <= 0:
        raise EPError(f"jax_ep: the runtime has no low-latency buffers for {cfg} (EPConfig.low_latency_buffers)")
    return rt.low_latency_offset, rt.low_latency_bytes


def _ll_attrs(cfg: EPConfig):
    from . import runtime

    offset, nbytes = low_latency_region(cfg)
    return _ffi.ll_attrs(
        group_id=runtime.group_id_for(cfg), num_experts=cfg.num_experts, hidden=cfg.hidden, num_topk=cfg.num_topk,
        max_tokens_per_rank=cfg.max_tokens_per_rank, timeout_ns=int(cfg.timeout_seconds * 1e9), ll_offset=offset,
        ll_bytes=nbytes)


def ll_dispatch_send(x, topk_idx, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    """-> pending buffers (dtype marker, token): ops reads use_fp8 back from the marker's dtype."""
    token = _ffi.ll_dispatch_send(x, topk_idx.astype(I32), use_fp8=use_fp8, attrs=_ll_attrs(cfg))
    return jnp.zeros((1,), FP8 if use_fp8 else BF16), token


def ll_dispatch_recv(pending, cfg: EPConfig, num_ranks: int, use_fp8: bool) -> LowLatencyDispatchOutput:
    token = pending[1]
    recv_x, scales, count, src_info, layout_range = _ffi.ll_dispatch_recv(
        token, num_ranks=num_ranks, num_local_experts=cfg.num_local_experts(num_ranks), use_fp8=use_fp8,
        attrs=_ll_attrs(cfg))
    return LowLatencyDispatchOutput(recv_x=recv_x, recv_x_scales=scales if use_fp8 else None, recv_count=count,
                                    handle=LowLatencyHandle(src_info=src_info, layout_range=layout_range))


def ll_combine_send(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    token = _ffi.ll_combine_send(expert_out, handle.src_info, handle.layout_range, attrs=_ll_attrs(cfg))
    return token, topk_idx.astype(I32), topk_weights.astype(F32)


def ll_combine_recv(pending, cfg: EPConfig, num_ranks: int):
    token, topk_idx, topk_weights = pending
    return _ffi.ll_combine_recv(token, topk_idx, topk_weights, attrs=_ll_attrs(cfg))


def ll_dispatch_transpose(cot_rows, topk_idx, handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    """d x of bf16 LL dispatch = an LL combine of the row cotangents with weight 1 on the first k naming each
    distinct expert (a token sent once to an expert gets that row's cotangent once)."""
    idx = reference.sanitize_topk(topk_idx, cfg.num_experts)
    K = idx.shape[1]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)  # earlier[k, j]: j < k
    repeated = jnp.any((idx[:, :, None] == idx[:, None, :]) & earlier[None], axis=2)
    weights = ((idx >= 0) & ~repeated).astype(F32)
    pending = ll_combine_send(cot_rows.astype(BF16), idx, weights, handle, cfg, num_ranks)
    return ll_combine_recv(pending, cfg, num_ranks)


def ll_combine_transpose(dy, expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, cfg: EPConfig,
                         num_ranks: int):
    """(d expert_out, d topk_weights) of LL combine. NOTE: moves data with the reference backend's XLA collectives
    (no dedicated kernel yet); results are the reference's exactly."""
    return reference.ll_combine_transpose(dy, expert_out, topk_idx, topk_weights, handle, cfg, num_ranks)
