// Staging-buffer layout of one rank (normal mode). Mirrored byte for byte by jax_ep/buffer_layout.py.
//
//   [signals | payload | scales | topk_idx | topk_weights | src_idx], each region aligned to kAlign bytes.
//   rows = max(capacity, R * T_max): dispatch receives up to `capacity` rows, combine one slot per (peer, token).
//   Dispatch and combine never use the region at the same time: every op begins with a group barrier.
// NOTE: the signal header sits at offset 0 with a fixed size, so calls with different configs (different offsets
// for the other regions) can share one allocation: the barrier counters and flags never move.
#pragma once

#include <cstdint>

#include "jax_ep/routing.h"

namespace jax_ep {

constexpr int64_t kAlign = 256;
constexpr int64_t kFp8Block = 128;
constexpr int64_t kSignalHeaderBytes = 1024;

// Byte offsets inside the signal header (u32 words); peers write the arrays indexed by *their* rank.
struct SignalHeader {
  static constexpr int64_t kBarrierIn = 0;     // u32[8]: barrier arrivals, monotonically increasing, one per op
  static constexpr int64_t kBarrierEpoch = 32; // u32: barriers this rank completed = the current op's epoch
  static constexpr int64_t kCountFlag = 64;    // u32[8]: epoch at which peer s published its counts
  static constexpr int64_t kDataFlag = 128;    // u32[8]: epoch at which peer s finished writing rows here
  static constexpr int64_t kBlockDone = 192;   // u32: last-block-done counter of the sending kernels (reset by it)
};

JAX_EP_HD int64_t align_up(int64_t n, int64_t a = kAlign) { return (n + a - 1) / a * a; }

struct BufferLayout {
  int64_t rows;            // staging rows
  int64_t counts;          // i32 [R][R] counts[src][dst], written by src into every rank
  int64_t expert_counts;   // i32 [R][L] expert_counts[src][l], written by src
  int64_t payload;         // rows x payload_stride bytes
  int64_t payload_stride;  // bytes per row (4 * hidden: the f32 worst case)
  int64_t scales;          // f32 [rows][ceil(H/128)]
  int64_t topk_idx;        // i32 [rows][K]
  int64_t topk_weights;    // f32 [rows][K]
  int64_t src_idx;         // i32 [rows]
  int64_t total;           // bytes
};

JAX_EP_HD int64_t signal_bytes(int64_t num_ranks, int64_t num_experts) {
  return align_up(kSignalHeaderBytes + 4 * (num_ranks * num_ranks + num_experts + 4 * num_ranks + 4));
}

JAX_EP_HD BufferLayout make_buffer_layout(int64_t hidden, int64_t num_topk, int64_t max_tokens_per_rank,
                                          int64_t num_ranks, int64_t capacity, int64_t num_experts) {
  BufferLayout b{};
  b.rows = capacity > num_ranks * max_tokens_per_rank ? capacity : num_ranks * max_tokens_per_rank;
  const int64_t scale_cols = (hidden + kFp8Block - 1) / kFp8Block;
  b.counts = kSignalHeaderBytes;
  b.expert_counts = b.counts + 4 * num_ranks * num_ranks;
  b.payload_stride = 4 * hidden;
  b.payload = signal_bytes(num_ranks, num_experts);
  b.scales = b.payload + align_up(b.rows * b.payload_stride);
  b.topk_idx = b.scales + align_up(b.rows * 4 * scale_cols);
  b.topk_weights = b.topk_idx + align_up(b.rows * 4 * num_topk);
  b.src_idx = b.topk_weights + align_up(b.rows * 4 * num_topk);
  b.total = b.src_idx + align_up(b.rows * 4);
  return b;
}

inline int64_t normal_buffer_bytes(int64_t hidden, int64_t num_topk, int64_t max_tokens_per_rank, int64_t num_ranks,
                                   int64_t capacity, int64_t num_experts) {
  return make_buffer_layout(hidden, num_topk, max_tokens_per_rank, num_ranks, capacity, num_experts).total;
}

}  // namespace jax_ep
