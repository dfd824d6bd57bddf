"""Low-latency (decode) mode: per-expert dispatch and weighted combine, fused or split, ordered by a state.

Semantics: docs/SPEC.md section 4. Program order: every LL op takes an optional `state` (jax_ep.LowLatencyState,
made by `low_latency_state(cfg)` inside shard_map) and, when given one, returns `(result, next_state)`; without
one it returns the result alone and starts a fresh chain (low_latency_chain.py explains the state machine and why
it exists). The fused ops (`low_latency_dispatch`, `low_latency_combine`) are one custom call each on the CUDA
backend, so they never leave data in flight and are safe without a state; the split phases are where the state is
required as soon as a program has any other LL op (docs/API.md).

Gradients: bf16 `low_latency_dispatch` (d x = an LL combine of the row cotangents) and `low_latency_combine`
(d expert_out, d topk_weights). FP8 dispatch and the split phases are not differentiable: a gradient through them
is an EPError on every backend.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp

from .. import low_latency_chain as state_order
from .backend_choice import backend_for
from ..config import EPConfig
from ..errors import EPError
from ..types import (LowLatencyCombinePending, LowLatencyDispatchOutput, LowLatencyDispatchPending,
                     LowLatencyHandle, LowLatencyState)
from .validation import (check_array, check_config, check_fp8_hidden, check_kernel_limits, check_low_latency_handle,
                         check_pending_config, check_routing, check_tokens, group_size)

BF16, F32 = jnp.bfloat16, jnp.float32

# What an LL op returns: the result alone, or (result, next state) when it was given a state.
DispatchResult = Union[LowLatencyDispatchOutput, Tuple[LowLatencyDispatchOutput, LowLatencyState]]
DispatchSendResult = Union[LowLatencyDispatchPending, Tuple[LowLatencyDispatchPending, LowLatencyState]]
CombineResult = Union[jax.Array, Tuple[jax.Array, LowLatencyState]]
CombineSendResult = Union[LowLatencyCombinePending, Tuple[LowLatencyCombinePending, LowLatencyState]]


def low_latency_state(cfg: Optional[EPConfig] = None) -> LowLatencyState:
    """A fresh LowLatencyState, made inside shard_map (cfg is accepted for symmetry and not needed)."""
    if cfg is not None:
        check_config("low_latency_state", cfg)
    return state_order.initial()


def check_low_latency_state(state: Union[LowLatencyState, jax.Array]) -> None:
    """Raises EPError when a low-latency op found a misordered program (reads the state back to the host)."""
    state_order.check(state)


def _state_in(op: str, state) -> LowLatencyState:
    if state is None:
        return state_order.initial()
    if not isinstance(state, LowLatencyState):
        raise EPError(f"jax_ep.{op}: state must be a jax_ep.LowLatencyState (from jax_ep.low_latency_state or the "
                      f"previous low-latency op), got {type(state).__name__}")
    check_array(op, "state.value", state.value, (4,), (jnp.int32,))
    return state


def _not_differentiable(op: str, fn, *args):
    """fn(*args) with a gradient rule that raises EPError naming the op (instead of a silent or wrong gradient)."""
    g = jax.custom_vjp(fn)

    def fwd(*a):
        return g(*a), None

    def bwd(res, cot):
        raise EPError(f"jax_ep.{op} is not differentiable (fp8 dispatch and the split send/recv phases have no "
                      f"gradient); differentiate the fused bf16 low_latency_dispatch / low_latency_combine instead")

    g.defvjp(fwd, bwd)
    return g(*args)


def _check_low_latency_dispatch(op, x, topk_idx, cfg, use_fp8):
    check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_kernel_limits(op, cfg, num_ranks, low_latency=True)
    check_array(op, "x", x, (None, cfg.hidden), (BF16,))
    check_tokens(op, "x", x.shape[0], cfg)
    check_routing(op, topk_idx, None, x.shape[0], cfg)
    if not isinstance(use_fp8, bool):
        raise EPError(f"jax_ep.{op}: use_fp8 must be a Python bool (static), got {type(use_fp8).__name__}")
    if use_fp8:
        check_fp8_hidden(op, cfg)
    return num_ranks, cfg.for_low_latency_call(num_ranks, x.shape[0])


def _result(result, state_out, state_given):
    return (result, state_out) if state_given is not None else result


# ---- dispatch -----------------------------------------------------------------------------------------------------
def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, cfg: EPConfig, use_fp8: bool = True, *,
                         state: Optional[LowLatencyState] = None) -> DispatchResult:
    """One copy per (token, expert) into per-expert rows (inside shard_map over cfg.axis_name).

    x [T, H] bf16, topk_idx [T, K] i32 (-1 / out of range: skipped). Returns LowLatencyDispatchOutput(recv_x
    [L, R*T_max, H] fp8 (use_fp8) or bf16, recv_x_scales [L, R*T_max, H//128] f32 or None, recv_count [L], handle),
    or (output, next_state) when `state` is given. Rows of an expert: source rank, then token index; rows >=
    recv_count are unspecified. Differentiable for bf16 (use_fp8=False). Raises EPError naming the argument.
    """
    op = "low_latency_dispatch"
    num_ranks, run_cfg = _check_low_latency_dispatch(op, x, topk_idx, cfg, use_fp8)
    st = _state_in(op, state)
    if use_fp8:
        backend = backend_for(cfg, op, low_latency=True)
        out, st_out = _not_differentiable(
            op + "(use_fp8=True)",
            lambda x_, i_, s_: _pair(backend.low_latency_dispatch(x_, i_, LowLatencyState(s_), run_cfg, num_ranks,
                                                                  True)),
            x, topk_idx, st.value)
    else:
        out, st_out = _low_latency_dispatch_vjp(cfg, run_cfg, num_ranks)(x, topk_idx, st.value)
    return _result(out, LowLatencyState(st_out), state)


# cfg: the user's config (the runtime knows it); run_cfg: cfg with its low-latency mode resolved for the call
# (EPConfig.for_low_latency_call), what the backend runs.
@functools.lru_cache(maxsize=None)
def _low_latency_dispatch_vjp(cfg: EPConfig, run_cfg: EPConfig, num_ranks: int):
    op = "low_latency_dispatch"

    @jax.custom_vjp
    def fn(x, topk_idx, state_value):
        out, st = backend_for(cfg, op, low_latency=True).low_latency_dispatch(x, topk_idx, LowLatencyState(state_value),
                                                                     run_cfg, num_ranks, False)
        return out, st.value

    def fwd(x, topk_idx, state_value):
        out, st = fn(x, topk_idx, state_value)
        return (out, st), (topk_idx, out.handle)

    def bwd(res, cot):
        topk_idx, handle = res
        cot_out, _ = cot
        dx = backend_for(cfg, op, low_latency=True).low_latency_dispatch_transpose(cot_out.recv_x, topk_idx, handle,
                                                                                   run_cfg, num_ranks)
        return dx.astype(BF16), None, None

    fn.defvjp(fwd, bwd)
    return fn


def low_latency_dispatch_send(x: jax.Array, topk_idx: jax.Array, cfg: EPConfig, use_fp8: bool = True, *,
                              state: Optional[LowLatencyState] = None) -> DispatchSendResult:
    """First half of low_latency_dispatch: starts the exchange and returns a LowLatencyDispatchPending (or
    (pending, next_state) when `state` is given); finish with low_latency_dispatch_recv. At most two sends may wait
    for their receives. Not differentiable."""
    op = "low_latency_dispatch_send"
    num_ranks, run_cfg = _check_low_latency_dispatch(op, x, topk_idx, cfg, use_fp8)
    st = _state_in(op, state)
    backend = backend_for(cfg, op, low_latency=True)
    buffers, st_out = _not_differentiable(
        op, lambda x_, i_, s_: _pair(backend.low_latency_dispatch_send(x_, i_, LowLatencyState(s_), run_cfg, num_ranks,
                                                                       use_fp8)),
        x, topk_idx, st.value)
    st_out = LowLatencyState(st_out)
    pending = LowLatencyDispatchPending(buffers=tuple(buffers), state=st_out, use_fp8=use_fp8, cfg=cfg,
                                        mode=run_cfg.low_latency_mode)
    return _result(pending, st_out, state)


def _pair(result):
    """(anything, LowLatencyState) -> (anything, state array): custom_vjp outputs stay plain arrays."""
    first, st = result
    return (tuple(first) if isinstance(first, list) else first), st.value


def low_latency_dispatch_recv(pending: LowLatencyDispatchPending, cfg: EPConfig, *,
                              state: Optional[LowLatencyState] = None) -> DispatchResult:
    """Second half of low_latency_dispatch: waits for the rows and returns LowLatencyDispatchOutput (or
    (output, next_state) when `state` is given; without one it continues from the pending's own state). cfg must be
    the EPConfig the send used (EPError naming the differing fields otherwise)."""
    op = "low_latency_dispatch_recv"
    num_ranks, st, backend = _recv_setup(op, pending, LowLatencyDispatchPending, "low_latency_dispatch_send", cfg,
                                         state)
    out, st_out = backend.low_latency_dispatch_recv(pending.buffers, st, _pending_run_cfg(pending, cfg), num_ranks,
                                                    pending.use_fp8)
    return _result(out, st_out, state)


def _recv_setup(op, pending, kind, producer, cfg, state):
    """Checks shared by the two split receives -> (R, the state to continue from, the backend)."""
    check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_kernel_limits(op, cfg, num_ranks, low_latency=True)
    _check_pending(op, pending, kind, producer)
    check_pending_config(op, pending.cfg, cfg, producer)
    st = pending.state if state is None else _state_in(op, state)
    return num_ranks, st, backend_for(cfg, op, low_latency=True)


def _pending_run_cfg(pending, cfg: EPConfig) -> EPConfig:
    """The config the send ran (its mode resolved for the send's tokens), for the receive to run alike."""
    if cfg.low_latency_mode != "auto":
        return cfg
    return dataclasses.replace(cfg, low_latency_mode=pending.mode)


def _check_pending(op, pending, kind, producer):
    if not isinstance(pending, kind):
        raise EPError(f"jax_ep.{op}: pending must be the {kind.__name__} returned by {producer}, got "
                      f"{type(pending).__name__}")
    if not isinstance(pending.buffers, tuple) or not pending.buffers or not all(
            hasattr(b, "shape") for b in pending.buffers) or not isinstance(pending.state, LowLatencyState) or (
            pending.mode not in ("per_expert", "per_rank")):
        raise EPError(f"jax_ep.{op}: pending is malformed (its buffers must be the arrays {producer} returned, "
                      f"unchanged)")


# ---- combine ------------------------------------------------------------------------------------------------------
def _check_low_latency_combine(op, expert_out, topk_idx, topk_weights, handle, cfg):
    """-> (R, the config the backend runs: cfg with its mode resolved for the call's T, as the dispatch's was)."""
    check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_kernel_limits(op, cfg, num_ranks, low_latency=True)
    num_tokens = topk_idx.shape[0] if getattr(topk_idx, "ndim", 0) >= 1 else 0
    check_tokens(op, "topk_idx", num_tokens, cfg)
    run_cfg = _combine_run_cfg(cfg, num_ranks, handle)
    check_low_latency_handle(op, handle, run_cfg, num_ranks)  # first: a config mismatch is named as such
    num_local, rows = cfg.num_local_experts(num_ranks), cfg.low_latency_rows(num_ranks)
    check_array(op, "expert_out", expert_out, (num_local, rows, cfg.hidden), (BF16,))
    if topk_weights is None:
        raise EPError(f"jax_ep.{op}: topk_weights [T, K] f32 is required (the combine is weighted)")
    check_routing(op, topk_idx, topk_weights, num_tokens, cfg)
    return num_ranks, run_cfg


def _combine_run_cfg(cfg: EPConfig, num_ranks: int, handle) -> EPConfig:
    """The config a combine runs: with "auto", the mode of the dispatch that made `handle` (per_rank handles carry
    msg_token), so the pair agrees whatever T each was given; the NVSHMEM kernels are per_expert only."""
    if cfg.low_latency_mode != "auto":
        return cfg
    per_rank = getattr(handle, "msg_token", None) is not None and not cfg.low_latency_over_nvshmem(num_ranks)
    return dataclasses.replace(cfg, low_latency_mode="per_rank" if per_rank else "per_expert")


def low_latency_combine(expert_out: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                        handle: LowLatencyHandle, cfg: EPConfig, *,
                        state: Optional[LowLatencyState] = None) -> CombineResult:
    """y[t] = sum_k topk_weights[t, k] * expert_out at (t, k)'s row, f32 accumulation, bf16 out (inside shard_map).

    expert_out [L, R*T_max, H] bf16, topk_idx / topk_weights [T, K] (the dispatch's routing; masked slots count 0
    whatever their weight), handle = the dispatch output's handle. Returns y [T, H] bf16, or (y, next_state) when
    `state` is given. Differentiable in expert_out and topk_weights.
    """
    op = "low_latency_combine"
    num_ranks, run_cfg = _check_low_latency_combine(op, expert_out, topk_idx, topk_weights, handle, cfg)
    st = _state_in(op, state)
    y, st_out = _low_latency_combine_vjp(cfg, run_cfg, num_ranks)(expert_out, topk_weights, topk_idx, handle,
                                                                  st.value)
    return _result(y, LowLatencyState(st_out), state)


@functools.lru_cache(maxsize=None)
def _low_latency_combine_vjp(cfg: EPConfig, run_cfg: EPConfig, num_ranks: int):
    op = "low_latency_combine"

    @jax.custom_vjp
    def fn(expert_out, topk_weights, topk_idx, handle, state_value):
        y, st = backend_for(cfg, op, low_latency=True).low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                                  LowLatencyState(state_value), run_cfg, num_ranks)
        return y, st.value

    def fwd(expert_out, topk_weights, topk_idx, handle, state_value):
        out = fn(expert_out, topk_weights, topk_idx, handle, state_value)
        return out, (expert_out, topk_weights, topk_idx, handle)

    def bwd(res, cot):
        expert_out, topk_weights, topk_idx, handle = res
        dy, _ = cot
        d_out, d_w = backend_for(cfg, op, low_latency=True).low_latency_combine_transpose(
            dy, expert_out, topk_idx, topk_weights, handle, run_cfg, num_ranks)
        return d_out, d_w.astype(F32), None, None, None

    fn.defvjp(fwd, bwd)
    return fn


def low_latency_combine_send(expert_out: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                             handle: LowLatencyHandle, cfg: EPConfig, *,
                             state: Optional[LowLatencyState] = None) -> CombineSendResult:
    """First half of low_latency_combine: sends expert rows back; returns LowLatencyCombinePending (or (pending,
    next_state)); finish with low_latency_combine_recv. Not differentiable."""
    op = "low_latency_combine_send"
    num_ranks, run_cfg = _check_low_latency_combine(op, expert_out, topk_idx, topk_weights, handle, cfg)
    st = _state_in(op, state)
    backend = backend_for(cfg, op, low_latency=True)
    buffers, st_out = _not_differentiable(
        op, lambda e_, i_, w_, h_, s_: _pair(backend.low_latency_combine_send(e_, i_, w_, h_, LowLatencyState(s_),
                                                                              run_cfg, num_ranks)),
        expert_out, topk_idx, topk_weights, handle, st.value)
    st_out = LowLatencyState(st_out)
    pending = LowLatencyCombinePending(buffers=tuple(buffers), state=st_out, cfg=cfg, mode=run_cfg.low_latency_mode)
    return _result(pending, st_out, state)


def low_latency_combine_recv(pending: LowLatencyCombinePending, cfg: EPConfig, *,
                             state: Optional[LowLatencyState] = None) -> CombineResult:
    """Second half of low_latency_combine: waits for the rows and returns y [T, H] bf16 (or (y, next_state)). cfg must
    be the EPConfig the send used (EPError naming the differing fields otherwise)."""
    op = "low_latency_combine_recv"
    num_ranks, st, backend = _recv_setup(op, pending, LowLatencyCombinePending, "low_latency_combine_send", cfg,
                                         state)
    y, st_out = backend.low_latency_combine_recv(pending.buffers, st, _pending_run_cfg(pending, cfg), num_ranks)
    return _result(y, st_out, state)
