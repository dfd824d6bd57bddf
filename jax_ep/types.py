"""Result and handle pytrees. NamedTuples of arrays: clean custom_vjp residuals, inspectable in tests.

Field meanings are documented in docs/API.md; every backend fills them identically.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax


class DispatchLayout(NamedTuple):
    num_tokens_per_rank: jax.Array  # [R] i32: local tokens that go to each rank (once per rank)
    num_tokens_per_expert: jax.Array  # [E] i32: local tokens that go to each expert (once per expert)
    is_token_in_rank: jax.Array  # [T, R] bool


class DispatchHandle(NamedTuple):
    send_pos: jax.Array  # [T, R] i32: position of token t among tokens sent to rank r, -1 if not sent
    recv_src_idx: jax.Array  # [C] i32: source token index per received row, -1 on padding
    recv_src_rank: jax.Array  # [C] i32: source rank per received row, -1 on padding
    recv_rank_counts: jax.Array  # [R] i32: rows that arrived from each source rank (before the capacity cut)
    send_row_offset: jax.Array  # [R] i32: first row of this rank's block in rank r's receive buffer


class DispatchOutput(NamedTuple):
    recv_x: jax.Array  # [C, H] x.dtype
    recv_x_scales: Optional[jax.Array]  # [C, H // 128] f32, fp8 input only
    recv_topk_idx: jax.Array  # [C, K] i32: local expert id or -1
    recv_topk_weights: jax.Array  # [C, K] f32
    num_recv_tokens: jax.Array  # () i32: rows that arrived (may exceed C)
    num_recv_tokens_per_expert: jax.Array  # [L] i32: arrived rows naming each local expert
    handle: DispatchHandle


class LowLatencyHandle(NamedTuple):
    src_info: jax.Array  # [L, R * T_max] i32: source token index per row, -1 on invalid rows
    layout_range: jax.Array  # [L, R] i32: rows of each local expert from each source rank
    # per_rank mode only (None in per_expert mode). Message j from source s = the j-th smallest token index of s
    # with at least one expert on this rank.
    msg_token: Optional[jax.Array] = None  # [R, T_max] i32: that token's index at s, -1 for j >= messages from s
    token_rows: Optional[jax.Array] = None  # [R, T_max, K] i32: for its k-th expert, l * R*T_max + row of the
    #                                         token in recv_x[l] when the expert is local (l), else -1


class LowLatencyDispatchOutput(NamedTuple):
    recv_x: jax.Array  # [L, R * T_max, H] float8_e4m3fn or bf16
    recv_x_scales: Optional[jax.Array]  # [L, R * T_max, H // 128] f32 (fp8 only)
    recv_count: jax.Array  # [L] i32
    handle: LowLatencyHandle


class LowLatencyState(NamedTuple):
    """Program order of the low-latency ops, as data (like a PRNG key): each LL op takes one and returns the next.

    value [4] i32 = [seq, in_flight, error, 0]: LL ops this chain has run, sends of this chain waiting for their
    receive (0..2), and a sticky error mask (jax_ep.check_low_latency_state decodes it). Make one with
    `jax_ep.low_latency_state(cfg)` inside shard_map; docs/API.md shows the decode-loop pattern.
    """

    value: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyDispatchPending:
    """What `low_latency_dispatch_send` leaves in flight for `low_latency_dispatch_recv`.

    buffers: backend-private arrays; state: the chain state after the send (the receive continues from it when it
    is given no state); use_fp8, cfg (the send's EPConfig, which the receive must match) and mode (the send's
    low-latency mode, "auto" resolved for its tokens; the receive runs the same): static (part of the pytree
    structure, not arrays).
    """

    buffers: tuple
    state: LowLatencyState
    use_fp8: bool = dataclasses.field(default=True, metadata=dict(static=True))
    cfg: Optional[Any] = dataclasses.field(default=None, metadata=dict(static=True))
    mode: Optional[str] = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowLatencyCombinePending:
    """What `low_latency_combine_send` leaves in flight for `low_latency_combine_recv` (see the dispatch one)."""

    buffers: tuple
    state: LowLatencyState
    cfg: Optional[Any] = dataclasses.field(default=None, metadata=dict(static=True))
    mode: Optional[str] = dataclasses.field(default=None, metadata=dict(static=True))
