"""The reference backend: SPEC semantics with XLA collectives (padded `lax.all_to_all`), runs anywhere.

Every function runs inside `shard_map` over `cfg.axis_name` and takes `num_ranks` (R, static). Written for
clarity: it is the oracle the CUDA kernels are checked against, not the fast path.

Normal mode moves, per destination rank, the tokens that go there ([R, T_max, ...] padded buffers, one
`all_to_all`), then compacts them on the receiver in (source rank, token index) order. Low-latency mode moves
per (destination rank, local expert, token) slots ([R, L, T_max, ...]) and compacts per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import fp8
from .. import low_latency_chain as state_order
from ..config import EPConfig
from ..types import (DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyDispatchOutput,
                      LowLatencyHandle, LowLatencyState)

I32 = jnp.int32


def sanitize_topk(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Expert ids outside [0, E) become -1 (SPEC §3: never a crash, never an out-of-bounds write)."""
    return jnp.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, -1).astype(I32)


def _exchange(a: jax.Array, cfg: EPConfig) -> jax.Array:
    """[R, ...] -> [R, ...]: slot r goes to rank r; slot s of the result came from rank s."""
    return lax.all_to_all(a, cfg.axis_name, 0, 0)


def _pad_tokens(a: jax.Array, t_max: int, axis: int) -> jax.Array:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, t_max - a.shape[axis])
    return jnp.pad(a, pad)


def stable_argsort(keys: jax.Array, axis: int = -1) -> jax.Array:
    """argsort that keeps equal keys in index order, by sorting unique composite keys (key, index).

    NOTE: does not rely on the sort's own stability flag: on XLA:GPU a stable argsort of boolean keys at a few
    hundred elements has put rows of one source rank out of order (jax 0.11.2), which would misattribute
    low-latency rows.
    """
    keys = jnp.asarray(keys, I32)
    n = keys.shape[axis]
    shape = [1] * keys.ndim
    shape[axis] = n
    index = jnp.arange(n, dtype=I32).reshape(shape)
    return jnp.argsort(keys * n + index, axis=axis).astype(I32)


def _expert_mask(idx: jax.Array, num_experts: int) -> jax.Array:
    """[T, K] sanitized ids -> [T, E] bool: token names expert e (once, however often it repeats)."""
    return jnp.any(idx[:, :, None] == jnp.arange(num_experts, dtype=I32)[None, None, :], axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Normal mode
# ----------------------------------------------------------------------------------------------------------------
def layout(topk_idx, cfg: EPConfig, num_ranks: int) -> DispatchLayout:
    idx = sanitize_topk(topk_idx, cfg.num_experts)
    per_expert = _expert_mask(idx, cfg.num_experts)  # [T, E]
    in_rank = jnp.any(per_expert.reshape(idx.shape[0], num_ranks, -1), axis=2)  # [T, R]
    return DispatchLayout(
        num_tokens_per_rank=in_rank.sum(0, dtype=I32),
        num_tokens_per_expert=per_expert.sum(0, dtype=I32),
        is_token_in_rank=in_rank,
    )


def _send_positions(in_rank: jax.Array) -> jax.Array:
    """[T, R] bool -> [T, R] i32: index of the token among those sent to each rank, -1 if not sent."""
    return jnp.where(in_rank, jnp.cumsum(in_rank, axis=0, dtype=I32) - 1, -1)


def _scatter_to_slots(rows: jax.Array, send_pos: jax.Array, t_max: int, per_dest: bool = False) -> jax.Array:
    """rows [T, ...] (or [T, R, ...] with per_dest: one value per destination), send_pos [T, R] -> [R, T_max, ...].

    Slot (r, send_pos[t, r]) holds row t for destination r; unsent slots are 0. Built as a gather through the
    inverse permutation (sorting send_pos per destination), which XLA runs well on every platform.
    """
    num_tokens, num_ranks = send_pos.shape
    token_of_slot = jnp.argsort(jnp.where(send_pos >= 0, send_pos, num_tokens), axis=0).T  # [R, T]
    filled = jnp.arange(num_tokens)[None, :] < jnp.sum(send_pos >= 0, axis=0)[:, None]  # [R, T]
    if per_dest:
        slots = rows[token_of_slot, jnp.arange(num_ranks)[:, None]]
    else:
        slots = rows[token_of_slot]
    slots = jnp.where(filled.reshape(filled.shape + (1,) * (slots.ndim - 2)), slots, jnp.zeros((), rows.dtype))
    return _pad_tokens(slots, t_max, axis=1)


def _row_sources(recv_rank_counts: jax.Array, capacity: int):
    """For each receive row i < C: (source rank, index within that source's block, valid)."""
    ends = jnp.cumsum(recv_rank_counts)
    starts = ends - recv_rank_counts
    rows = jnp.arange(capacity, dtype=I32)
    src = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), recv_rank_counts.shape[0] - 1).astype(I32)
    within = rows - starts[src]
    valid = rows < ends[-1]
    return src, jnp.where(valid, within, 0), valid


def _compact(slots: jax.Array, recv_rank_counts: jax.Array, capacity: int, pad_value=0) -> jax.Array:
    """[R, T_max, ...] received slots -> [C, ...] rows in (source rank, token) order; padding = pad_value."""
    src, within, valid = _row_sources(recv_rank_counts, capacity)
    rows = slots[src, within]
    mask = valid.reshape((capacity,) + (1,) * (rows.ndim - 1))
    return jnp.where(mask, rows, jnp.asarray(pad_value, rows.dtype))


def _count_matrix(send_counts: jax.Array, cfg: EPConfig) -> jax.Array:
    """All ranks' send counts: [R_src, R_dst]."""
    return lax.all_gather(send_counts, cfg.axis_name)


def dispatch(x, x_scales, topk_idx, topk_weights, cfg: EPConfig, num_ranks: int) -> DispatchOutput:
    t_max, capacity = cfg.max_tokens_per_rank, cfg.capacity(num_ranks)
    num_local = cfg.num_local_experts(num_ranks)
    me = lax.axis_index(cfg.axis_name)
    idx = sanitize_topk(topk_idx, cfg.num_experts)
    lay = layout(idx, cfg, num_ranks)
    send_pos = _send_positions(lay.is_token_in_rank)
    counts = _count_matrix(lay.num_tokens_per_rank, cfg)  # [R_src, R_dst]
    recv_rank_counts = counts[:, me]
    send_row_offset = jnp.sum(jnp.where(jnp.arange(num_ranks)[:, None] < me, counts, 0), axis=0, dtype=I32)

    # Per destination r, the token's expert ids as r's local ids (-1 where the expert lives elsewhere).
    ranks = jnp.arange(num_ranks, dtype=I32)[:, None, None]
    local_idx = jnp.where((idx >= 0)[None] & (idx[None] // num_local == ranks), idx[None] - ranks * num_local, -1)
    local_w = jnp.where(local_idx >= 0, topk_weights[None].astype(jnp.float32), 0.0)  # [R, T, K]
    token_ids = jnp.arange(x.shape[0], dtype=I32)

    def moved(rows, pad_value=0, per_dest=False):  # rows [T, ...] (or [T, R, ...]) -> received [C, ...]
        slots = _exchange(_scatter_to_slots(rows, send_pos, t_max, per_dest), cfg)
        return slots, _compact(slots, recv_rank_counts, capacity, pad_value)

    recv_x = moved(x)[1]
    recv_scales = None if x_scales is None else moved(x_scales.astype(jnp.float32))[1]
    slot_idx, recv_topk_idx = moved(jnp.moveaxis(local_idx, 0, 1), -1, per_dest=True)  # slots [R_src, T_max, K]
    recv_topk_weights = moved(jnp.moveaxis(local_w, 0, 1), per_dest=True)[1]
    recv_src_idx = moved(token_ids, -1)[1]
    src, _, valid = _row_sources(recv_rank_counts, capacity)
    recv_src_rank = jnp.where(valid, src, -1)

    # Every row that arrived counts, including rows cut by the capacity (like num_recv_tokens).
    arrived = jnp.arange(t_max)[None, :] < recv_rank_counts[:, None]  # [R_src, T_max]
    names = jnp.any(slot_idx[..., None] == jnp.arange(num_local, dtype=I32), axis=2)  # [R_src, T_max, L]
    per_expert = jnp.sum(names & arrived[..., None], axis=(0, 1), dtype=I32)

    handle = DispatchHandle(send_pos=send_pos, recv_src_idx=recv_src_idx, recv_src_rank=recv_src_rank,
                            recv_rank_counts=recv_rank_counts, send_row_offset=send_row_offset)
    return DispatchOutput(recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=recv_topk_idx,
                          recv_topk_weights=recv_topk_weights, num_recv_tokens=jnp.sum(recv_rank_counts, dtype=I32),
                          num_recv_tokens_per_expert=per_expert, handle=handle)


def cached_dispatch(payload, weights, handle: DispatchHandle, cfg: EPConfig, num_ranks: int):
    """Moves [T, W] rows (and optional [T, K] weights) along the routes of an earlier dispatch."""
    capacity, t_max = cfg.capacity(num_ranks), cfg.max_tokens_per_rank

    def move(rows):
        slots = _exchange(_scatter_to_slots(rows, handle.send_pos, t_max), cfg)
        return _compact(slots, handle.recv_rank_counts, capacity)

    return move(payload), (None if weights is None else move(weights))


def combine(values, weights, handle: DispatchHandle, cfg: EPConfig, num_ranks: int):
    """Sends each received row back to its source; the source sums over ranks in f32."""
    t_max = cfg.max_tokens_per_rank
    capacity = handle.recv_src_rank.shape[0]
    _, within, _ = _row_sources(handle.recv_rank_counts, capacity)
    valid = handle.recv_src_rank >= 0
    # Padding rows scatter out of bounds (slot t_max) and are dropped; rows cut by capacity were never here.
    src = jnp.where(valid, handle.recv_src_rank, 0)
    slot = jnp.where(valid, within, t_max)

    def reduce(rows):
        buf = jnp.zeros((num_ranks, t_max) + rows.shape[1:], jnp.float32)
        buf = buf.at[src, slot].set(rows.astype(jnp.float32), mode="drop")
        back = _exchange(buf, cfg)  # [R_expert_rank, T_max, ...]: my j-th token sent to that rank
        pos = handle.send_pos  # [T, R]
        gathered = back[jnp.arange(num_ranks)[None, :], jnp.maximum(pos, 0)]  # [T, R, ...]
        mask = (pos >= 0).reshape(pos.shape + (1,) * (gathered.ndim - 2))
        return jnp.sum(jnp.where(mask, gathered, 0.0), axis=1)

    y = reduce(values).astype(values.dtype)
    y_weights = None if weights is None else reduce(weights).astype(jnp.float32)
    return y, y_weights


# ----------------------------------------------------------------------------------------------------------------
# Low-latency mode
# ----------------------------------------------------------------------------------------------------------------
def _low_latency_slot_mask(idx, cfg: EPConfig, num_ranks: int) -> jax.Array:
    """[T, K] sanitized ids -> [R, L, T_max] bool: token t goes to local expert l of rank r."""
    mask = _expert_mask(idx, cfg.num_experts).T.reshape(num_ranks, -1, idx.shape[0])
    return _pad_tokens(mask, cfg.max_tokens_per_rank, axis=2)


def _low_latency_row_slots(layout_range: jax.Array, src_info: jax.Array, t_max: int):
    """Per row (l, i): the (source rank, token) slot it came from, and whether the row is valid."""
    ends = jnp.cumsum(layout_range, axis=1)  # [L, R]
    rows = jnp.arange(src_info.shape[1], dtype=I32)
    src = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(ends)
    src = jnp.minimum(src, layout_range.shape[1] - 1).astype(I32)
    valid = src_info >= 0
    return src, jnp.where(valid, src_info, t_max), valid


def low_latency_to_experts(slots, slot_mask, cfg: EPConfig, num_ranks: int):
    """Sender slots [R, L, T_max, ...] + mask -> per-expert rows [L, R*T_max, ...] and the handle.

    Rows of an expert are ordered by source rank, then token index; invalid rows are zero, src_info -1.
    """
    return _low_latency_compact(_exchange(slots, cfg), _exchange(slot_mask, cfg), cfg, num_ranks)


def low_latency_to_sources(rows, handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    """Per-expert rows [L, R*T_max, ...] -> on each source rank [R_owner, L, T_max, ...] (f32; missing = 0)."""
    t_max = cfg.max_tokens_per_rank
    num_local = rows.shape[0]
    src, token, _ = _low_latency_row_slots(handle.layout_range, handle.src_info, t_max)
    buf = jnp.zeros((num_ranks, num_local, t_max) + rows.shape[2:], jnp.float32)
    experts = jnp.broadcast_to(jnp.arange(num_local)[:, None], src.shape)
    buf = buf.at[src, experts, token].set(rows.astype(jnp.float32), mode="drop")
    return _exchange(buf, cfg)


def _per_pair(back, idx, num_ranks):
    """back [R, L, T_max, W], idx [T, K] -> [T, K, W]: the row returned for each (token, k); 0 where k invalid."""
    num_local = back.shape[1]
    tokens = jnp.arange(idx.shape[0])[:, None]
    safe = jnp.maximum(idx, 0)
    vals = back[safe // num_local, safe % num_local, tokens]
    return jnp.where((idx >= 0)[..., None], vals, 0.0)


def _masked_weights(idx, topk_weights):
    """Weights of masked (-1 / out-of-range) top-k slots are ignored entirely: 0, even where the weight is NaN."""
    return jnp.where(idx >= 0, topk_weights.astype(jnp.float32), 0.0)


# The state machine of low_latency_chain.py: the reference backend moves data with XLA collectives (no shared
# buffers, nothing to deadlock) but applies the same state transitions, so both backends report the same errors.
def low_latency_dispatch_send(x, topk_idx, state: LowLatencyState, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    """-> (buffers: the exchanged slots + mask, next state)."""
    idx = sanitize_topk(topk_idx, cfg.num_experts)
    mask = _low_latency_slot_mask(idx, cfg, num_ranks)  # [R, L, T_max]
    payload = fp8.quantize_blocks(x) if use_fp8 else (x,)
    slots = []
    for part in payload:  # x (bf16) or (q, scales)
        part = _pad_tokens(part, cfg.max_tokens_per_rank, axis=0)
        full = jnp.broadcast_to(part[None, None], mask.shape + part.shape[1:])
        slots.append(jnp.where(mask.reshape(mask.shape + (1,)), full, jnp.zeros((), full.dtype)))
    buffers = tuple(_exchange(s, cfg) for s in slots) + (_exchange(mask, cfg),)
    if cfg.low_latency_mode_for(num_ranks) == "per_rank":  # the message headers: every source's routing
        buffers += (_broadcast(_pad_rows(idx, cfg.max_tokens_per_rank, -1), cfg, num_ranks),)
    return buffers, state_order.after_send(state)


def _pad_rows(a, t_max, value):
    return jnp.pad(a, [(0, t_max - a.shape[0])] + [(0, 0)] * (a.ndim - 1), constant_values=value)


def _broadcast(a, cfg: EPConfig, num_ranks: int):
    """a [...] on every rank -> [R_src, ...]: every rank's a, by source rank."""
    return _exchange(jnp.broadcast_to(a[None], (num_ranks,) + a.shape), cfg)


def low_latency_dispatch_recv(buffers, state: LowLatencyState, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    """-> (LowLatencyDispatchOutput, next state)."""
    return _low_latency_unpack(buffers, cfg, num_ranks, use_fp8), state_order.after_recv(state)


def low_latency_dispatch(x, topk_idx, state: LowLatencyState, cfg: EPConfig, num_ranks: int, use_fp8: bool):
    """Fused dispatch: send and receive in one op (one state step)."""
    buffers, _ = low_latency_dispatch_send(x, topk_idx, state, cfg, num_ranks, use_fp8)
    return _low_latency_unpack(buffers, cfg, num_ranks, use_fp8), state_order.after_fused(state)


def _low_latency_unpack(buffers, cfg, num_ranks, use_fp8) -> LowLatencyDispatchOutput:
    per_rank = cfg.low_latency_mode_for(num_ranks) == "per_rank"
    if per_rank:
        *buffers, src_idx = buffers
    *received, recv_mask = buffers  # already exchanged by low_latency_dispatch_send
    rows_list, recv_count, handle = [], None, None
    for part in received:
        rows, recv_count, handle = _low_latency_compact(part, recv_mask, cfg, num_ranks)
        rows_list.append(rows)
    if per_rank:
        msg_token, token_rows = _per_rank_tables(src_idx, recv_mask, cfg, num_ranks)
        handle = handle._replace(msg_token=msg_token, token_rows=token_rows)
    scales = rows_list[1] if use_fp8 else None
    return LowLatencyDispatchOutput(recv_x=rows_list[0], recv_x_scales=scales, recv_count=recv_count, handle=handle)


def _low_latency_compact(recv, recv_mask, cfg, num_ranks):
    """Receiver side of low_latency_to_experts: exchanged slots [R_src, L, T_max, ...] -> rows [L, R*T_max, ...]."""
    num_local, t_max = recv_mask.shape[1], cfg.max_tokens_per_rank
    flat_mask = jnp.swapaxes(recv_mask, 0, 1).reshape(num_local, num_ranks * t_max)
    order = stable_argsort(~flat_mask, axis=1)  # valid slots first, in (source rank, token) order
    recv_count = flat_mask.sum(1, dtype=I32)
    valid = jnp.arange(num_ranks * t_max)[None, :] < recv_count[:, None]
    src_rank, token = order // t_max, order % t_max
    rows = recv[src_rank, jnp.arange(num_local)[:, None], token]
    rows = jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 2)), rows, jnp.zeros((), rows.dtype))
    handle = LowLatencyHandle(src_info=jnp.where(valid, token, -1),
                              layout_range=jnp.sum(recv_mask, axis=2, dtype=I32).T)
    return rows, recv_count, handle


def low_latency_combine_send(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, state: LowLatencyState,
                    cfg: EPConfig, num_ranks: int):
    """-> (buffers: rows back at their sources + the routing, next state)."""
    idx = sanitize_topk(topk_idx, cfg.num_experts)
    if cfg.low_latency_mode_for(num_ranks) == "per_rank":
        return _per_rank_partials(expert_out, idx, topk_weights, handle, cfg, num_ranks), state_order.after_send(state)
    back = low_latency_to_sources(expert_out, handle, cfg, num_ranks)
    return (back, idx, _masked_weights(idx, topk_weights)), state_order.after_send(state)


def low_latency_combine_recv(buffers, state: LowLatencyState, cfg: EPConfig, num_ranks: int):
    """-> (y [T, H] bf16, next state)."""
    return _low_latency_combine_sum(buffers, cfg, num_ranks), state_order.after_recv(state)


def low_latency_combine(expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, state: LowLatencyState, cfg: EPConfig,
               num_ranks: int):
    """Fused combine: send and receive in one op (one state step)."""
    buffers, _ = low_latency_combine_send(expert_out, topk_idx, topk_weights, handle, state, cfg, num_ranks)
    return _low_latency_combine_sum(buffers, cfg, num_ranks), state_order.after_fused(state)


def _low_latency_combine_sum(buffers, cfg: EPConfig, num_ranks: int):
    if cfg.low_latency_mode_for(num_ranks) == "per_rank":
        return _per_rank_sum(buffers, cfg, num_ranks)
    return _low_latency_weighted_sum(buffers, num_ranks)


# ---- per_rank mode (EPConfig.low_latency_mode): one message per (token, destination rank) ------------------------
def _per_rank_tables(src_idx, recv_mask, cfg: EPConfig, num_ranks: int):
    """The receiver's message tables (handle.msg_token [R, T_max], handle.token_rows [R, T_max, K]).

    src_idx [R_src, T_max, K]: every source's sanitized routing (-1 padded); recv_mask [R_src, L, T_max]: source
    token t names local expert l. Message j from s = the j-th token of s naming a local expert; its k-th expert's
    row in recv_x[l] is (rows of l from sources < s) + (tokens of s before t naming l).
    """
    num_local, t_max = recv_mask.shape[1], cfg.max_tokens_per_rank
    me = lax.axis_index(cfg.axis_name)
    is_local = (src_idx >= 0) & (src_idx // num_local == me)  # [R, T_max, K]
    local = jnp.where(is_local, src_idx % num_local, 0)
    counts = jnp.sum(recv_mask, axis=2, dtype=I32)  # [R, L]
    first_row = jnp.cumsum(counts, axis=0, dtype=I32) - counts  # [R, L]: rows of l from earlier sources
    position = jnp.cumsum(recv_mask, axis=2, dtype=I32) - 1  # [R, L, T_max]: index among s's tokens naming l
    s_ix = jnp.arange(num_ranks)[:, None, None]
    t_ix = jnp.arange(t_max)[None, :, None]
    row = first_row[s_ix, local] + position[s_ix, local, t_ix]  # [R, T_max, K]
    by_token = jnp.where(is_local, local * (num_ranks * t_max) + row, -1).astype(I32)
    routed = jnp.any(is_local, axis=2)  # [R, T_max]
    order = stable_argsort(~routed, axis=1)  # routed tokens first, in token order
    valid = jnp.arange(t_max)[None, :] < jnp.sum(routed, axis=1, dtype=I32)[:, None]
    msg_token = jnp.where(valid, order, -1).astype(I32)
    token_rows = jnp.where(valid[..., None], jnp.take_along_axis(by_token, order[..., None], axis=1), -1)
    return msg_token, token_rows.astype(I32)


def _per_rank_partials(expert_out, idx, topk_weights, handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    """Expert side of the per_rank combine: partial[s, t] = bf16(sum over k of t's experts on this rank, in k order,
    of w[t, k] * f32(row)), sent back to s. -> (partials by owner rank [R, T_max, H] bf16, rank mask [T, R])."""
    t_max, num_tokens = cfg.max_tokens_per_rank, idx.shape[0]
    weights = _broadcast(_pad_rows(_masked_weights(idx, topk_weights), t_max, 0.0), cfg, num_ranks)  # [R, T_max, K]
    flat = expert_out.reshape(-1, expert_out.shape[-1]).astype(jnp.float32)
    rows = handle.token_rows
    vals = jnp.where((rows >= 0)[..., None], flat[jnp.maximum(rows, 0)], 0.0)  # [R, T_max, K, H]
    tok = jnp.maximum(handle.msg_token, 0)
    w = jnp.where(rows >= 0, jnp.take_along_axis(weights, tok[..., None], axis=1), 0.0)  # [R, T_max, K]
    partial = jnp.einsum("sjk,sjkh->sjh", w, vals, precision=lax.Precision.HIGHEST).astype(jnp.bfloat16)
    by_token = jnp.zeros_like(partial).at[jnp.arange(num_ranks)[:, None], jnp.where(
        handle.msg_token >= 0, handle.msg_token, t_max)].set(partial, mode="drop")
    back = _exchange(by_token, cfg)  # [R_owner, T_max, H]: owner d's partial for my token t
    num_local = cfg.num_local_experts(num_ranks)
    owner = jnp.where(idx >= 0, idx // num_local, -1)
    rank_mask = jnp.any(owner[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1)  # [T, R]
    return back[:, :num_tokens], rank_mask


def _per_rank_sum(buffers, cfg: EPConfig, num_ranks: int):
    """Source side: y[t] = bf16(sum over ranks d that t names, ascending, of f32(partial from d))."""
    back, rank_mask = buffers
    terms = jnp.where(rank_mask.T[..., None], back.astype(jnp.float32), 0.0)  # [R, T, H]
    y = terms[0]
    for d in range(1, num_ranks):  # ascending rank order, as the CUDA receive adds them
        y = y + terms[d]
    return y.astype(jnp.bfloat16)


def _low_latency_weighted_sum(buffers, num_ranks):
    back, idx, weights = buffers
    per_pair = _per_pair(back, idx, num_ranks)  # [T, K, H] f32
    return jnp.einsum("tk,tkh->th", weights, per_pair, precision=lax.Precision.HIGHEST).astype(jnp.bfloat16)


def low_latency_dispatch_transpose(cot_rows, topk_idx, handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int):
    """d x for bf16 LL dispatch: each token gets the sum of its rows' cotangents (once per distinct expert)."""
    idx = sanitize_topk(topk_idx, cfg.num_experts)
    back = low_latency_to_sources(cot_rows, handle, cfg, num_ranks)  # [R, L, T_max, H]
    num_tokens = idx.shape[0]
    mask = _expert_mask(idx, cfg.num_experts)  # [T, E]
    per_expert = back[:, :, :num_tokens].reshape(cfg.num_experts, num_tokens, -1)  # [E, T, H]
    return jnp.einsum("te,eth->th", mask.astype(jnp.float32), per_expert, precision=lax.Precision.HIGHEST)


def low_latency_combine_transpose(dy, expert_out, topk_idx, topk_weights, handle: LowLatencyHandle, cfg: EPConfig,
                         num_ranks: int):
    """(d expert_out, d topk_weights) of low_latency_combine."""
    idx = sanitize_topk(topk_idx, cfg.num_experts)
    dy = dy.astype(jnp.float32)
    # d expert_out at the row of (t, e) = sum over k naming e of w[t, k] * dy[t].
    onehot = (idx[:, :, None] == jnp.arange(cfg.num_experts, dtype=I32)).astype(jnp.float32)  # [T, K, E]
    coeff = jnp.einsum("tk,tke->et", _masked_weights(idx, topk_weights), onehot, precision=lax.Precision.HIGHEST)
    per_slot = coeff[:, :, None] * dy[None]  # [E, T, H]
    slots = _pad_tokens(per_slot.reshape(num_ranks, -1, *per_slot.shape[1:]), cfg.max_tokens_per_rank, axis=2)
    d_rows, _, _ = low_latency_to_experts(slots, _low_latency_slot_mask(idx, cfg, num_ranks), cfg, num_ranks)
    back = low_latency_to_sources(expert_out, handle, cfg, num_ranks)
    d_weights = jnp.einsum("th,tkh->tk", dy, _per_pair(back, idx, num_ranks), precision=lax.Precision.HIGHEST)
    return d_rows.astype(expert_out.dtype), jnp.where(idx >= 0, d_weights, 0.0)
