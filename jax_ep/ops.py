"""Public ops: validation, backend choice and gradients (custom_vjp). Semantics: SPEC.md and docs/API.md.

Gradients: dispatch and combine are each other's transposes. d/dx of dispatch is a combine of the recv_x
cotangent; d/d expert_out of combine is a cached dispatch (through the handle) of the y cotangent; weight
cotangents take the same routes. The backward passes use the same backend as the forward pass.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading

import jax
import jax.numpy as jnp

from . import reference, runtime
from .config import FP8_BLOCK, LOW_LATENCY_AUTO_MAX_TOKENS, EPConfig
from .handle import (DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyCombinePending,
                     LowLatencyDispatchOutput, LowLatencyDispatchPending, LowLatencyHandle)
from .validation import (EPError, check_array, check_fp8_hidden, check_handle, check_routing, check_tokens,
                         group_size)

log = logging.getLogger("jax_ep")
BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn


def _check_config(op, cfg):
    if not isinstance(cfg, EPConfig):
        raise EPError(f"jax_ep.{op}: cfg must be an EPConfig, got {type(cfg).__name__}")


def _backend(cfg: EPConfig, fn: str):
    """The module implementing backend function `fn` for cfg (docs/API.md, backend interface)."""
    name = runtime.resolve_backend(cfg)
    if name == "reference":
        return reference
    runtime.runtime_for(cfg)  # the CUDA backend needs its buffers: prewarm at trace time if not done yet
    module = importlib.import_module(".cuda_backend", __package__)
    if fn.startswith("ll_") and not cfg.uses_low_latency_buffers():
        if cfg.backend == "auto":
            runtime._log_once(("no-ll-buffers", cfg), "jax_ep: %s has no low-latency buffers (max_tokens_per_rank > "
                              "%d and low_latency_buffers=None); low-latency ops use the reference backend", cfg,
                              LOW_LATENCY_AUTO_MAX_TOKENS)
            return reference
        raise EPError(f"jax_ep: {fn}: this config has no low-latency buffers (low_latency_buffers="
                      f"{cfg.low_latency_buffers}, max_tokens_per_rank={cfg.max_tokens_per_rank}; None turns them "
                      f"off above {LOW_LATENCY_AUTO_MAX_TOKENS}); pass low_latency_buffers=True to run the "
                      f"low-latency ops on the CUDA backend")
    return module  # cuda_backend implements every function of the backend interface (docs/API.md)


# ----------------------------------------------------------------------------------------------------------------
# Normal mode
# ----------------------------------------------------------------------------------------------------------------
def get_dispatch_layout(topk_idx, cfg: EPConfig) -> DispatchLayout:
    _check_config("get_dispatch_layout", cfg)
    num_ranks = group_size(cfg, "get_dispatch_layout")
    num_tokens = topk_idx.shape[0] if getattr(topk_idx, "ndim", 0) >= 1 else 0
    check_routing("get_dispatch_layout", topk_idx, None, num_tokens, cfg)
    check_tokens("get_dispatch_layout", "topk_idx", num_tokens, cfg)
    return _backend(cfg, "layout").layout(topk_idx, cfg, num_ranks)


def dispatch(x, topk_idx, topk_weights, cfg: EPConfig, x_scales=None) -> DispatchOutput:
    """Sends each token once to every rank that holds one of its experts (SPEC §3)."""
    op = "dispatch"
    _check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_array(op, "x", x, (None, cfg.hidden), (BF16, FP8))
    num_tokens = x.shape[0]
    check_tokens(op, "x", num_tokens, cfg)
    check_routing(op, topk_idx, topk_weights, num_tokens, cfg)
    if x.dtype == FP8:
        check_fp8_hidden(op, cfg)
        if x_scales is None:
            raise EPError(f"jax_ep.{op}: x_scales [T, H//128] f32 is required when x is float8_e4m3fn")
        check_array(op, "x_scales", x_scales, (num_tokens, cfg.hidden // FP8_BLOCK), (F32,))
        # FP8 inputs are not differentiable (SPEC §3): no custom_vjp on this path.
        return _backend(cfg, "dispatch").dispatch(x, x_scales, topk_idx, topk_weights, cfg, num_ranks)
    if x_scales is not None:
        raise EPError(f"jax_ep.{op}: x_scales must be None when x is bfloat16 (got an array)")
    return _dispatch_vjp(cfg, num_ranks)(x, topk_idx, topk_weights)


@functools.lru_cache(maxsize=None)
def _dispatch_vjp(cfg: EPConfig, num_ranks: int):
    @jax.custom_vjp
    def fn(x, topk_idx, topk_weights):
        return _backend(cfg, "dispatch").dispatch(x, None, topk_idx, topk_weights, cfg, num_ranks)

    def fwd(x, topk_idx, topk_weights):
        out = fn(x, topk_idx, topk_weights)
        return out, (out.handle, out.recv_topk_idx)

    def bwd(res, cot: DispatchOutput):
        handle, recv_topk_idx = res
        # recv_topk_weights[row, k] is topk_weights[t, k] only where k's expert lives on the receiving rank.
        w_cot = jnp.where(recv_topk_idx >= 0, cot.recv_topk_weights, 0.0)
        dx, dw = _backend(cfg, "combine").combine(cot.recv_x, w_cot, handle, cfg, num_ranks)
        return dx.astype(cot.recv_x.dtype), None, dw

    fn.defvjp(fwd, bwd)
    return fn


def _check_dispatch_handle(op, handle, cfg, num_ranks, num_tokens=None):
    capacity = cfg.capacity(num_ranks)
    check_handle(op, handle, DispatchHandle, {
        "send_pos": (num_tokens, num_ranks), "recv_src_idx": (capacity,), "recv_src_rank": (capacity,),
        "recv_rank_counts": (num_ranks,), "send_row_offset": (num_ranks,)})


def combine(expert_out, handle: DispatchHandle, cfg: EPConfig, topk_weights=None):
    """y[t] = sum over the ranks that received t of expert_out[row of t there], f32 accumulation (SPEC §3).

    Returns (y [T, H] expert_out.dtype, y_weights [T, K] f32 or None when topk_weights is None).
    """
    op = "combine"
    _check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    capacity = cfg.capacity(num_ranks)
    check_array(op, "expert_out", expert_out, (capacity, cfg.hidden), (BF16, F32))
    _check_dispatch_handle(op, handle, cfg, num_ranks)
    if topk_weights is not None:
        check_array(op, "topk_weights", topk_weights, (capacity, cfg.num_topk), (F32,))
    return _combine_vjp(cfg, num_ranks, topk_weights is not None)(expert_out, topk_weights, handle)


@functools.lru_cache(maxsize=None)
def _combine_vjp(cfg: EPConfig, num_ranks: int, with_weights: bool):
    @jax.custom_vjp
    def fn(expert_out, weights, handle):
        return _backend(cfg, "combine").combine(expert_out, weights, handle, cfg, num_ranks)

    def fwd(expert_out, weights, handle):
        return fn(expert_out, weights, handle), handle

    def bwd(handle, cot):
        dy, dy_weights = cot
        d_out, d_w = _backend(cfg, "cached_dispatch").cached_dispatch(
            dy, dy_weights if with_weights else None, handle, cfg, num_ranks)
        return d_out.astype(dy.dtype), d_w, None

    fn.defvjp(fwd, bwd)
    return fn


# ----------------------------------------------------------------------------------------------------------------
# Low-latency mode
# ----------------------------------------------------------------------------------------------------------------
# Program order of the low-latency ops. On the CUDA backend all LL ops of a runtime share one device epoch counter
# and two buffer halves (cuda/include/jax_ep/low_latency.h): every rank must run them in the same order, and a send
# must never be queued before the receive of the op two epochs back. XLA is free to reorder independent custom
# calls (it ran two independent dispatch -> combine chains as send a, send b, recv b, send b' and deadlocked), so
# each public LL op's inputs take the previous LL op's output (same trace) through an optimization_barrier: the
# ops run in the order the program called them. A send and its receive stay apart (send a, send b, recv a, recv b
# keeps its order), so the split phases still overlap with other work.
# NOTE: per thread (each thread traces its own programs). It keeps the last LL op's output of the last trace alive
# until the next LL op is traced (one value, bounded); jax_check_tracer_leaks would report that value.
_ll_order = threading.local()


def _current_trace():
    from jax._src import core

    return core.trace_ctx.trace


def _after_previous_ll_op(*operands):
    """operands, made to depend on the last LL op's output traced in the current trace (if any)."""
    last = getattr(_ll_order, "last", None) if getattr(_ll_order, "trace", None) is _current_trace() else None
    if last is None:
        return operands
    *operands, _ = jax.lax.optimization_barrier((*operands, last))
    return tuple(operands)


def _record_ll_op(output):
    _ll_order.trace, _ll_order.last = _current_trace(), output


def _check_ll_dispatch(op, x, topk_idx, cfg, use_fp8):
    _check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_array(op, "x", x, (None, cfg.hidden), (BF16,))
    check_tokens(op, "x", x.shape[0], cfg)
    check_routing(op, topk_idx, None, x.shape[0], cfg)
    if not isinstance(use_fp8, bool):
        raise EPError(f"jax_ep.{op}: use_fp8 must be a Python bool (static), got {type(use_fp8).__name__}")
    if use_fp8:
        check_fp8_hidden(op, cfg)
    return num_ranks


def low_latency_dispatch(x, topk_idx, cfg: EPConfig, use_fp8: bool = True) -> LowLatencyDispatchOutput:
    """One copy per (token, expert) into per-expert rows [L, R*T_max, H] (SPEC §4)."""
    num_ranks = _check_ll_dispatch("low_latency_dispatch", x, topk_idx, cfg, use_fp8)
    x, topk_idx = _after_previous_ll_op(x, topk_idx)
    if use_fp8:  # fp8 outputs are not differentiable
        out = _ll_dispatch_fused(x, topk_idx, cfg, num_ranks, True)
    else:
        out = _ll_dispatch_vjp(cfg, num_ranks)(x, topk_idx)
    _record_ll_op(out.recv_count)
    return out


def _ll_dispatch_fused(x, topk_idx, cfg, num_ranks, use_fp8):
    send = _backend(cfg, "ll_dispatch_send")
    pending = send.ll_dispatch_send(x, topk_idx, cfg, num_ranks, use_fp8)
    return send.ll_dispatch_recv(pending, cfg, num_ranks, use_fp8)


@functools.lru_cache(maxsize=None)
def _ll_dispatch_vjp(cfg: EPConfig, num_ranks: int):
    @jax.custom_vjp
    def fn(x, topk_idx):
        return _ll_dispatch_fused(x, topk_idx, cfg, num_ranks, False)

    def fwd(x, topk_idx):
        out = fn(x, topk_idx)
        return out, (topk_idx, out.handle)

    def bwd(res, cot: LowLatencyDispatchOutput):
        topk_idx, handle = res
        dx = _backend(cfg, "ll_dispatch_transpose").ll_dispatch_transpose(cot.recv_x, topk_idx, handle, cfg,
                                                                           num_ranks)
        return dx.astype(BF16), None

    fn.defvjp(fwd, bwd)
    return fn


def low_latency_dispatch_send(x, topk_idx, cfg: EPConfig, use_fp8: bool = True) -> LowLatencyDispatchPending:
    """First half of low_latency_dispatch: starts the exchange; finish with low_latency_dispatch_recv."""
    num_ranks = _check_ll_dispatch("low_latency_dispatch_send", x, topk_idx, cfg, use_fp8)
    x, topk_idx = _after_previous_ll_op(x, topk_idx)
    buffers = _backend(cfg, "ll_dispatch_send").ll_dispatch_send(x, topk_idx, cfg, num_ranks, use_fp8)
    _record_ll_op(buffers[-1])
    return LowLatencyDispatchPending(buffers=tuple(buffers))


def low_latency_dispatch_recv(pending: LowLatencyDispatchPending, cfg: EPConfig) -> LowLatencyDispatchOutput:
    op = "low_latency_dispatch_recv"
    _check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    if not isinstance(pending, LowLatencyDispatchPending):
        raise EPError(f"jax_ep.{op}: pending must be the LowLatencyDispatchPending returned by "
                      f"low_latency_dispatch_send, got {type(pending).__name__}")
    use_fp8 = pending.buffers[0].dtype == jnp.float8_e4m3fn
    buffers = _after_previous_ll_op(*pending.buffers)
    out = _backend(cfg, "ll_dispatch_recv").ll_dispatch_recv(buffers, cfg, num_ranks, use_fp8)
    _record_ll_op(out.recv_count)
    return out


def _check_ll_combine(op, expert_out, topk_idx, topk_weights, handle, cfg):
    _check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    num_local, rows = cfg.num_local_experts(num_ranks), cfg.low_latency_rows(num_ranks)
    check_array(op, "expert_out", expert_out, (num_local, rows, cfg.hidden), (BF16,))
    num_tokens = topk_idx.shape[0] if getattr(topk_idx, "ndim", 0) >= 1 else 0
    check_tokens(op, "topk_idx", num_tokens, cfg)
    check_routing(op, topk_idx, topk_weights, num_tokens, cfg)
    check_handle(op, handle, LowLatencyHandle, {"src_info": (num_local, rows), "layout_range": (num_local, num_ranks)})
    return num_ranks


def low_latency_combine(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, cfg: EPConfig):
    """y[t] = sum_k topk_weights[t, k] * expert_out at (t, k)'s row; f32 accumulation, bf16 out (SPEC §4)."""
    num_ranks = _check_ll_combine("low_latency_combine", expert_out, topk_idx, topk_weights, handle, cfg)
    expert_out, topk_weights, topk_idx = _after_previous_ll_op(expert_out, topk_weights, topk_idx)
    y = _ll_combine_vjp(cfg, num_ranks)(expert_out, topk_weights, topk_idx, handle)
    _record_ll_op(y)
    return y


def _ll_combine_fused(expert_out, topk_idx, topk_weights, handle, cfg, num_ranks):
    module = _backend(cfg, "ll_combine_send")
    pending = module.ll_combine_send(expert_out, topk_idx, topk_weights, handle, cfg, num_ranks)
    return module.ll_combine_recv(pending, cfg, num_ranks)


@functools.lru_cache(maxsize=None)
def _ll_combine_vjp(cfg: EPConfig, num_ranks: int):
    @jax.custom_vjp
    def fn(expert_out, topk_weights, topk_idx, handle):
        return _ll_combine_fused(expert_out, topk_idx, topk_weights, handle, cfg, num_ranks)

    def fwd(expert_out, topk_weights, topk_idx, handle):
        return fn(expert_out, topk_weights, topk_idx, handle), (expert_out, topk_weights, topk_idx, handle)

    def bwd(res, dy):
        expert_out, topk_weights, topk_idx, handle = res
        d_out, d_w = _backend(cfg, "ll_combine_transpose").ll_combine_transpose(
            dy, expert_out, topk_idx, topk_weights, handle, cfg, num_ranks)
        return d_out, d_w.astype(F32), None, None

    fn.defvjp(fwd, bwd)
    return fn


def low_latency_combine_send(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle,
                             cfg: EPConfig) -> LowLatencyCombinePending:
    """First half of low_latency_combine: sends expert rows back; finish with low_latency_combine_recv."""
    num_ranks = _check_ll_combine("low_latency_combine_send", expert_out, topk_idx, topk_weights, handle, cfg)
    expert_out, topk_idx, topk_weights = _after_previous_ll_op(expert_out, topk_idx, topk_weights)
    buffers = _backend(cfg, "ll_combine_send").ll_combine_send(expert_out, topk_idx, topk_weights, handle, cfg,
                                                               num_ranks)
    _record_ll_op(buffers[0])
    return LowLatencyCombinePending(buffers=tuple(buffers))


def low_latency_combine_recv(pending: LowLatencyCombinePending, cfg: EPConfig):
    op = "low_latency_combine_recv"
    _check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    if not isinstance(pending, LowLatencyCombinePending):
        raise EPError(f"jax_ep.{op}: pending must be the LowLatencyCombinePending returned by "
                      f"low_latency_combine_send, got {type(pending).__name__}")
    buffers = _after_previous_ll_op(*pending.buffers)
    y = _backend(cfg, "ll_combine_recv").ll_combine_recv(buffers, cfg, num_ranks)
    _record_ll_op(y)
    return y
