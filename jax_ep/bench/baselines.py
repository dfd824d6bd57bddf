"""What a JAX user has without jax_ep: the same exchanges built from `lax.all_to_all` and `ragged_all_to_all`.

Every function runs inside shard_map over `axis` and takes the same routing as jax_ep's ops, so the harness can
time all contenders on one input. Each returns the received rows (and what the matching combine needs).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jax_ep.backends.reference import stable_argsort

I32 = jnp.int32


def _dest_ranks(topk_idx, num_experts, num_ranks):
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    return jnp.where(valid, topk_idx // (num_experts // num_ranks), -1)


def padded_all_to_all_dispatch(x, topk_idx, num_experts, num_ranks, axis):
    """Dense all_to_all of [R, T, H]: every peer gets a T-row slot, rows not routed there are zeroed."""
    dest = _dest_ranks(topk_idx, num_experts, num_ranks)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(num_ranks), axis=1)  # [T, R]
    send = jnp.where(in_rank.T[:, :, None], x[None], jnp.zeros((), x.dtype))  # [R, T, H]
    return lax.all_to_all(send, axis, 0, 0)


def padded_all_to_all_combine(recv, axis):
    """Reverse of the padded dispatch plus the sum over ranks."""
    back = lax.all_to_all(recv, axis, 0, 0)
    return jnp.sum(back.astype(jnp.float32), axis=0).astype(recv.dtype)


def _ragged_plan(rows_dest, num_ranks, axis):
    """Sort rows by destination and exchange sizes: what ragged_all_to_all needs (offsets in rows)."""
    order = stable_argsort(jnp.where(rows_dest >= 0, rows_dest, num_ranks))
    send_sizes = jnp.sum(rows_dest[:, None] == jnp.arange(num_ranks), axis=0, dtype=I32)
    input_offsets = jnp.cumsum(send_sizes, dtype=I32) - send_sizes
    recv_sizes = lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)
    # output_offsets[r]: where my rows start in rank r's output = sum of sizes that lower ranks send to r.
    all_sizes = lax.all_gather(send_sizes, axis)  # [R_src, R_dst]
    me = lax.axis_index(axis)
    output_offsets = jnp.sum(jnp.where(jnp.arange(num_ranks)[:, None] < me, all_sizes, 0), axis=0, dtype=I32)
    return order, input_offsets, send_sizes, output_offsets, recv_sizes


def ragged_dispatch(rows, rows_dest, capacity, num_ranks, axis):
    """ragged_all_to_all of rows [M, H] to their destination ranks (-1: not sent) into [capacity, H]."""
    order, in_off, send_sizes, out_off, recv_sizes = _ragged_plan(rows_dest, num_ranks, axis)
    output = jnp.zeros((capacity,) + rows.shape[1:], rows.dtype)
    recv = lax.ragged_all_to_all(rows[order], output, in_off, send_sizes, out_off, recv_sizes, axis_name=axis)
    return recv, (order, in_off, send_sizes, out_off, recv_sizes)


def ragged_per_rank_rows(x, topk_idx, num_experts, num_ranks):
    """One copy per destination rank: rows [T*R, H] (token t for rank r) and their destinations."""
    dest = _dest_ranks(topk_idx, num_experts, num_ranks)
    in_rank = jnp.any(dest[:, :, None] == jnp.arange(num_ranks), axis=1)  # [T, R]
    rows_dest = jnp.where(in_rank, jnp.arange(num_ranks, dtype=I32), -1).reshape(-1)
    return jnp.repeat(x, num_ranks, axis=0), rows_dest


def ragged_per_expert_rows(x, topk_idx, num_experts, num_ranks):
    """One copy per (token, expert): rows [T*K, H] and their destination ranks."""
    dest = _dest_ranks(topk_idx, num_experts, num_ranks).reshape(-1)
    return jnp.repeat(x, topk_idx.shape[1], axis=0), dest


def ragged_combine(recv, plan, num_tokens, copies, axis):
    """Reverse ragged_all_to_all of the received rows, then the sum of each token's copies."""
    order, in_off, send_sizes, _, recv_sizes = plan
    # Going back, the roles swap: I send each source's block (where it landed in my output) to the offset it
    # came from in that source's sorted input.
    recv_in_off = jnp.cumsum(recv_sizes, dtype=I32) - recv_sizes
    back_out_off = lax.all_to_all(in_off, axis, 0, 0, tiled=True)
    output = jnp.zeros((num_tokens * copies,) + recv.shape[1:], recv.dtype)
    back = lax.ragged_all_to_all(recv, output, recv_in_off, recv_sizes, back_out_off, send_sizes, axis_name=axis)
    unsorted = jnp.zeros_like(back).at[order].set(back)
    return jnp.sum(unsorted.reshape(num_tokens, copies, -1).astype(jnp.float32), axis=1).astype(recv.dtype)
