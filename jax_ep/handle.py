"""Result and handle pytrees. NamedTuples of arrays: clean custom_vjp residuals, inspectable in tests.

Field meanings are documented in docs/API.md; every backend fills them identically.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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


class LowLatencyDispatchOutput(NamedTuple):
    recv_x: jax.Array  # [L, R * T_max, H] float8_e4m3fn or bf16
    recv_x_scales: Optional[jax.Array]  # [L, R * T_max, H // 128] f32 (fp8 only)
    recv_count: jax.Array  # [L] i32
    handle: LowLatencyHandle


class LowLatencyDispatchPending(NamedTuple):
    """What `low_latency_dispatch_send` leaves in flight for `low_latency_dispatch_recv` (backend-private arrays)."""

    buffers: tuple


class LowLatencyCombinePending(NamedTuple):
    """What `low_latency_combine_send` leaves in flight for `low_latency_combine_recv` (backend-private arrays)."""

    buffers: tuple
