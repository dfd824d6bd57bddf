"""Python mirror of the native staging-buffer layout (cuda/include/jax_ep/buffer_layout.h).

`normal_buffer_bytes` must agree with the C++ `normal_buffer_bytes` byte for byte: the runtime allocates this many
bytes per rank and the kernels address into it with the C++ offsets (tests/test_native_build.py compares both when
the extension is built).

Normal-mode staging of one rank (one cudaMalloc, offsets aligned to 256 bytes):
  signals   barrier / count / data flags, the R x R count matrix, per-expert counts, scratch
  payload   rows x row_bytes          row_bytes = 4 * hidden (worst case: an f32 payload of width hidden)
  scales    rows x 4 * ceil(hidden / 128)   (fp8 dispatch)
  topk_idx  rows x 4 * num_topk
  weights   rows x 4 * num_topk
  src_idx   rows x 4
with rows = max(capacity, num_ranks * max_tokens_per_rank): dispatch receives up to `capacity` rows; combine
receives one slot per (peer, token) = num_ranks * max_tokens_per_rank rows. The two never overlap in time
(every op starts with a group barrier), so they share the region.
"""

from __future__ import annotations

from .config import FP8_BLOCK

ALIGN = 256
# Fixed part of the signal area: flags and counters (u32) for up to 8 peers (kMaxGroupRanks).
SIGNAL_HEADER_BYTES = 1024


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def signal_bytes(num_ranks: int, num_experts: int) -> int:
    """Signal area: header + count matrix [R, R] + expert counts [R, E/R] + scratch [4 * R + 4] (all 4-byte)."""
    return _align(SIGNAL_HEADER_BYTES + 4 * (num_ranks * num_ranks + num_experts + 4 * num_ranks + 4))


def staging_rows(max_tokens_per_rank: int, num_ranks: int, capacity: int) -> int:
    return max(capacity, num_ranks * max_tokens_per_rank)


def normal_buffer_bytes(hidden: int, num_topk: int, max_tokens_per_rank: int, num_ranks: int, capacity: int,
                        num_experts: int) -> int:
    """Bytes of the normal-mode staging buffer one rank allocates (same formula as the C++ side)."""
    for name, v in (("hidden", hidden), ("num_topk", num_topk), ("max_tokens_per_rank", max_tokens_per_rank),
                    ("num_ranks", num_ranks), ("capacity", capacity), ("num_experts", num_experts)):
        if int(v) <= 0:
            raise ValueError(f"normal_buffer_bytes: {name} must be positive, got {v}")
    rows = staging_rows(max_tokens_per_rank, num_ranks, capacity)
    scale_cols = (hidden + FP8_BLOCK - 1) // FP8_BLOCK
    total = signal_bytes(num_ranks, num_experts)
    total += _align(rows * 4 * hidden)        # payload
    total += _align(rows * 4 * scale_cols)    # fp8 scales
    total += _align(rows * 4 * num_topk)      # topk_idx
    total += _align(rows * 4 * num_topk)      # topk weights
    total += _align(rows * 4)                 # src token index
    return total


# ---- low-latency region (cuda/include/jax_ep/low_latency.h) ---------------------------------------------------
# region = [scratch u32[1024] | half 0 | half 1]; LL op n uses half n % 2. One half:
#   c_flags u32[E] | d_flags u32[E] | d_counts i32[E] | rows, each of the first three aligned to 256 bytes;
#   rows = max(dispatch messages [E * T_max] x msg_stride, combine rows [E * T_max] x 2H).
LOW_LATENCY_SCRATCH_BYTES = 4 * 1024
LOW_LATENCY_MSG_HEADER = 16


def low_latency_msg_stride(hidden: int) -> int:
    """Bytes of one dispatch message: 16-byte header, bf16 payload (the larger format), fp8 scales."""
    scale_cols = (hidden + FP8_BLOCK - 1) // FP8_BLOCK
    return _align(LOW_LATENCY_MSG_HEADER + 2 * hidden + 4 * scale_cols, 16)


def low_latency_buffer_bytes(hidden: int, max_tokens_per_rank: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the low-latency region one rank allocates (same formula as the C++ side)."""
    for name, v in (("hidden", hidden), ("max_tokens_per_rank", max_tokens_per_rank), ("num_ranks", num_ranks),
                    ("num_experts", num_experts)):
        if int(v) <= 0:
            raise ValueError(f"low_latency_buffer_bytes: {name} must be positive, got {v}")
    flags = 3 * _align(4 * num_experts)
    slots = num_experts * max_tokens_per_rank
    rows = max(slots * low_latency_msg_stride(hidden), slots * 2 * hidden)
    return LOW_LATENCY_SCRATCH_BYTES + 2 * _align(flags + rows)
