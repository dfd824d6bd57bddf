"""Normal (high-throughput) mode: get_dispatch_layout, dispatch, combine, with validation and gradients.

Semantics: docs/SPEC.md section 3. Gradients: dispatch and combine are each other's transposes. d/dx of dispatch is
a combine of the recv_x cotangent; d/d expert_out of combine is a cached dispatch (through the handle) of the y
cotangent; weight cotangents take the same routes. The backward passes use the same backend as the forward pass.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .backend_choice import backend_for
from ..config import FP8_BLOCK, EPConfig
from ..errors import EPError
from ..types import DispatchHandle, DispatchLayout, DispatchOutput
from .validation import (check_array, check_config, check_dispatch_handle, check_fp8_hidden, check_kernel_limits,
                         check_routing, check_tokens, group_size)

BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn


def get_dispatch_layout(topk_idx: jax.Array, cfg: EPConfig) -> DispatchLayout:
    """Routing counts of this rank's tokens (inside shard_map over cfg.axis_name).

    topk_idx [T, K] i32 (values outside [0, E) mean "no expert") -> DispatchLayout(num_tokens_per_rank [R] i32,
    num_tokens_per_expert [E] i32, is_token_in_rank [T, R] bool). A token counts once per rank and once per expert.
    Raises EPError/EPTypeError naming the argument for a wrong shape or dtype, T > cfg.max_tokens_per_rank, a
    config beyond the CUDA kernels' limits (docs/API.md, "Errors and edge cases"), or a call outside shard_map over
    cfg.axis_name.
    """
    op = "get_dispatch_layout"
    check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_kernel_limits(op, cfg, num_ranks, low_latency=False)
    num_tokens = topk_idx.shape[0] if getattr(topk_idx, "ndim", 0) >= 1 else 0
    check_routing(op, topk_idx, None, num_tokens, cfg)
    check_tokens(op, "topk_idx", num_tokens, cfg)
    return backend_for(cfg, op).layout(topk_idx, cfg, num_ranks)


def dispatch(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, cfg: EPConfig,
             x_scales: Optional[jax.Array] = None) -> DispatchOutput:
    """Sends each token once to every rank that holds one of its experts (inside shard_map over cfg.axis_name).

    x [T, H] bf16 or f32 (f32 is rounded to bf16 before it is sent; dx then comes back f32), or float8_e4m3fn with
    x_scales [T, H//128] f32; topk_idx [T, K] i32, topk_weights [T, K] f32.
    Returns DispatchOutput: recv_x [C, H], recv_x_scales (fp8 only), recv_topk_idx [C, K] (local ids, -1 elsewhere),
    recv_topk_weights [C, K], num_recv_tokens () i32, num_recv_tokens_per_expert [L] i32, handle. Rows are ordered by
    source rank, then token index; rows beyond num_recv_tokens are padding (0 / -1). Differentiable in x and
    topk_weights for bf16 input. Raises EPError/EPTypeError naming the argument on bad input.
    """
    op = "dispatch"
    check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_kernel_limits(op, cfg, num_ranks, low_latency=False)
    check_array(op, "x", x, (None, cfg.hidden), (BF16, F32, FP8))
    num_tokens = x.shape[0]
    check_tokens(op, "x", num_tokens, cfg)
    if topk_weights is None:
        raise EPError(f"jax_ep.{op}: topk_weights [T, K] f32 is required (it becomes recv_topk_weights); pass "
                      f"jnp.ones((T, K), jnp.float32) for a layer without routing weights")
    check_routing(op, topk_idx, topk_weights, num_tokens, cfg)
    if x.dtype == FP8:
        check_fp8_hidden(op, cfg)
        if x_scales is None:
            raise EPError(f"jax_ep.{op}: x_scales [T, H//128] f32 is required when x is float8_e4m3fn")
        check_array(op, "x_scales", x_scales, (num_tokens, cfg.hidden // FP8_BLOCK), (F32,))
        return _dispatch_fp8_vjp(cfg, num_ranks)(x, x_scales, topk_idx, topk_weights)
    if x_scales is not None:
        raise EPError(f"jax_ep.{op}: x_scales must be None when x is {x.dtype} (got an array)")
    return _dispatch_vjp(cfg, num_ranks, x.dtype == F32)(x, topk_idx, topk_weights)


@functools.lru_cache(maxsize=None)
def _dispatch_vjp(cfg: EPConfig, num_ranks: int, f32_input: bool):
    @jax.custom_vjp
    def fn(x, topk_idx, topk_weights):
        # bf16 on the wire; an f32 x is rounded to bf16 here, on the sending rank (docs/API.md, f32 activations)
        return backend_for(cfg, "dispatch").dispatch(x.astype(BF16), None, topk_idx, topk_weights, cfg, num_ranks)

    def fwd(x, topk_idx, topk_weights):
        out = fn(x, topk_idx, topk_weights)
        return out, (out.handle, out.recv_topk_idx)

    def bwd(res, cot: DispatchOutput):
        handle, recv_topk_idx = res
        # recv_topk_weights[row, k] is topk_weights[t, k] only where k's expert lives on the receiving rank.
        w_cot = jnp.where(recv_topk_idx >= 0, cot.recv_topk_weights, 0.0)
        # f32 input: the bf16 row cotangents are summed in f32 and returned unrounded (moved as f32 values)
        rows = cot.recv_x.astype(F32) if f32_input else cot.recv_x
        dx, dw = backend_for(cfg, "dispatch").combine(rows, w_cot, handle, cfg, num_ranks)
        return dx.astype(F32 if f32_input else cot.recv_x.dtype), None, dw

    fn.defvjp(fwd, bwd)
    return fn


@functools.lru_cache(maxsize=None)
def _dispatch_fp8_vjp(cfg: EPConfig, num_ranks: int):
    """FP8 dispatch: not differentiable (SPEC): a gradient through it is an EPError on every backend."""

    @jax.custom_vjp
    def fn(x, x_scales, topk_idx, topk_weights):
        return backend_for(cfg, "dispatch").dispatch(x, x_scales, topk_idx, topk_weights, cfg, num_ranks)

    def fwd(*args):
        return fn(*args), None

    def bwd(res, cot):
        raise EPError("jax_ep.dispatch: fp8 input (x float8_e4m3fn with x_scales) is not differentiable; "
                      "differentiate a bf16 dispatch instead")

    fn.defvjp(fwd, bwd)
    return fn


def combine(expert_out: jax.Array, handle: DispatchHandle, cfg: EPConfig,
            topk_weights: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[jax.Array]]:
    """Sends each received row back to its source rank and sums there (inside shard_map over cfg.axis_name).

    expert_out [C, H] bf16 or f32, handle = the DispatchOutput.handle of the matching dispatch, topk_weights
    [C, K] f32 or None. Returns (y [T, H] expert_out.dtype, y_weights [T, K] f32 or None): y[t] = sum over the ranks
    that received t of expert_out[row of t there], accumulated in f32. Differentiable in expert_out and topk_weights.
    Raises EPError naming the argument on bad input, including a handle whose dispatch had another group size or
    capacity, or more tokens per rank than cfg.max_tokens_per_rank (the handle is checked against cfg first).
    """
    op = "combine"
    check_config(op, cfg)
    num_ranks = group_size(cfg, op)
    check_kernel_limits(op, cfg, num_ranks, low_latency=False)
    check_dispatch_handle(op, handle, cfg, num_ranks)
    capacity = cfg.capacity(num_ranks)
    check_array(op, "expert_out", expert_out, (capacity, cfg.hidden), (BF16, F32))
    if topk_weights is not None:
        check_array(op, "topk_weights", topk_weights, (capacity, cfg.num_topk), (F32,))
    return _combine_vjp(cfg, num_ranks, topk_weights is not None)(expert_out, topk_weights, handle)


@functools.lru_cache(maxsize=None)
def _combine_vjp(cfg: EPConfig, num_ranks: int, with_weights: bool):
    @jax.custom_vjp
    def fn(expert_out, weights, handle):
        return backend_for(cfg, "combine").combine(expert_out, weights, handle, cfg, num_ranks)

    def fwd(expert_out, weights, handle):
        return fn(expert_out, weights, handle), handle

    def bwd(handle, cot):
        dy, dy_weights = cot
        d_out, d_w = backend_for(cfg, "combine").cached_dispatch(
            dy, dy_weights if with_weights else None, handle, cfg, num_ranks)
        return d_out.astype(dy.dtype), d_w, None

    fn.defvjp(fwd, bwd)
    return fn


def capacity_mask(topk_idx: jax.Array, cfg: EPConfig, capacity_per_expert: int) -> jax.Array:
    """GShard-style token dropping: topk_idx [T, K] i32 with -1 for every (token, expert) pair beyond its expert's
    capacity, pairs counted in token order (t ascending, then k). Local (no communication), inside or outside
    shard_map. A token naming an expert twice is one pair (kept or dropped together). Ids outside [0, E) become -1.
    Raises EPError naming the argument for a wrong shape/dtype or a negative capacity.
    """
    op = "capacity_mask"
    check_config(op, cfg)
    if isinstance(capacity_per_expert, bool) or not isinstance(capacity_per_expert, (int, np.integer)) or \
            capacity_per_expert < 0:
        raise EPError(f"jax_ep.{op}: capacity_per_expert must be an int >= 0, got {capacity_per_expert!r}")
    num_tokens = topk_idx.shape[0] if getattr(topk_idx, "ndim", 0) >= 1 else 0
    check_routing(op, topk_idx, None, num_tokens, cfg)
    E, (T, K) = cfg.num_experts, topk_idx.shape
    idx = jnp.where((topk_idx >= 0) & (topk_idx < E), topk_idx, -1).astype(jnp.int32)
    same = idx[:, :, None] == idx[:, None, :]  # [T, K, K]
    earlier = jnp.tril(jnp.ones((K, K), bool), -1)[None]  # [1, k, j]: j < k
    first = (idx >= 0) & ~jnp.any(same & earlier, axis=2)  # first slot naming its expert in the token
    flat = idx.reshape(-1)
    counted = (flat[:, None] == jnp.arange(E, dtype=jnp.int32)[None, :]) & first.reshape(-1)[:, None]  # [T*K, E]
    before = jnp.cumsum(counted, axis=0, dtype=jnp.int32) - counted  # pairs of that expert strictly earlier
    pos = jnp.take_along_axis(before, jnp.maximum(flat, 0)[:, None], axis=1)[:, 0].reshape(T, K)
    kept_first = first & (pos < capacity_per_expert)
    keep = kept_first | jnp.any(same & kept_first[:, None, :], axis=2)  # repeats follow their first slot
    return jnp.where(keep & (idx >= 0), idx, -1)
