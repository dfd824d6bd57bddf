// Low-latency mode (SPEC §4): layout of its staging region and the parameters of its four ops. Mirrored byte for
// byte by jax_ep/buffer_layout.py (low_latency_buffer_bytes).
//
// The staging buffer of every rank is [normal region | low-latency region]; the runtime places the low-latency
// region after the largest normal layout of its configs and passes (offset, bytes) to the handlers, so every LL
// config of a program addresses the same region:
//
//   region = [scratch: u32 per local expert (kMaxLowLatencyExperts) | half 0 | half 1]
//
// LL ops (dispatch and combine alike) take consecutive epochs n = 1, 2, ... from one device counter; op n uses
// half n % 2. A rank writes into a peer's half only after that peer has finished reading the op two epochs back
// from the same half (the peer's "consumed" word of that half), so no op ever waits for a clean step and data of
// consecutive ops never collides. At most two LL ops (of all LL configs together) may be between their send and
// their receive at once; a third send waits for the first receive (and ends in the device timeout if that receive
// is queued after it). One half:
//
//   c_flags  u32[E]          combine: epoch at which the owner of expert e finished writing its rows here
//   d_flags  u32[L][R]       dispatch: epoch at which source rank s finished writing its rows of local expert l
//   d_counts i32[L][R]       dispatch: rows source s wrote for local expert l (valid once d_flags says so)
//   rows                     dispatch: messages [L][R][T_max], msg_stride bytes each:
//                              [i32 source token, 12 bytes pad | payload (H fp8 or 2H bf16) | fp8: S f32 scales]
//                            combine:  rows [E][T_max] of 2H bytes (bf16), row (e, t) = expert e's output for t
//
// NOTE: every flag word has exactly one writer (d_flags[l][s]: rank s; c_flags[e]: e's owner), so two writes to
// one word are ordered by that writer's stream, and a late write from an old epoch can never overwrite a newer one.
#pragma once

#include <cstdint>

#include "jax_ep/buffer_layout.h"
#include "jax_ep/constants.h"
#include "jax_ep/params.h"

namespace jax_ep {

constexpr int64_t kMaxLowLatencyExperts = 1024;  // per-expert scratch counters of the combine sender (E <= 1024)
constexpr int64_t kLowLatencyScratchBytes = 4 * kMaxLowLatencyExperts;
constexpr int64_t kLowLatencyMsgHeader = 16;

// Words of the fixed signal header (buffer offset 0) used by the low-latency ops.
struct LowLatencyHeader {
  static constexpr int64_t kEpoch = 256;     // u32: epoch of the last LL send on this rank
  static constexpr int64_t kSendDone = 260;  // u32: last-block-done counter of the send kernels (reset by it)
  static constexpr int64_t kRecvDone = 264;  // u32: last-block-done counter of the receive kernels (reset by it)
  // u32[2][8]: consumed[h][s] = the last epoch of half h that rank s finished reading (written by s). Per half, so
  // two ops in flight may be received in either order; within a half, epochs n-2, n, n+2 are strictly sequential.
  static constexpr int64_t kConsumed = 288;
};

struct LowLatencyLayout {
  int64_t scratch;      // buffer offset of the scratch counters
  int64_t half[2];      // buffer offsets of the two halves
  int64_t c_flags;      // offsets inside a half
  int64_t d_flags;
  int64_t d_counts;
  int64_t rows;
  int64_t msg_stride;   // dispatch message bytes
  int64_t half_needed;  // bytes this config needs in one half
};

JAX_EP_HD int64_t ll_msg_stride(int64_t hidden) {
  const int64_t scale_cols = (hidden + kFp8Block - 1) / kFp8Block;
  return align_up(kLowLatencyMsgHeader + 2 * hidden + 4 * scale_cols, 16);
}

// region_offset / half_bytes: where the runtime put the low-latency region and how big one half is; 0 for the
// size computation only.
JAX_EP_HD LowLatencyLayout make_low_latency_layout(int64_t hidden, int64_t max_tokens_per_rank, int64_t num_ranks,
                                                   int64_t num_experts, int64_t region_offset, int64_t half_bytes) {
  LowLatencyLayout b{};
  const int64_t E = num_experts;
  b.c_flags = 0;
  b.d_flags = align_up(4 * E);
  b.d_counts = b.d_flags + align_up(4 * E);
  b.rows = b.d_counts + align_up(4 * E);
  b.msg_stride = ll_msg_stride(hidden);
  const int64_t dispatch_end = b.rows + E * max_tokens_per_rank * b.msg_stride;  // L * R = E messages per token slot
  const int64_t combine_end = b.rows + E * max_tokens_per_rank * 2 * hidden;
  b.half_needed = align_up(dispatch_end > combine_end ? dispatch_end : combine_end);
  (void)num_ranks;
  b.scratch = region_offset;
  b.half[0] = region_offset + kLowLatencyScratchBytes;
  b.half[1] = b.half[0] + half_bytes;
  return b;
}

// Bytes of the low-latency region one rank needs for a config (both halves and the scratch).
inline int64_t low_latency_buffer_bytes(int64_t hidden, int64_t max_tokens_per_rank, int64_t num_ranks,
                                        int64_t num_experts) {
  return kLowLatencyScratchBytes +
         2 * make_low_latency_layout(hidden, max_tokens_per_rank, num_ranks, num_experts, 0, 0).half_needed;
}

// Group + low-latency region of one call.
struct LowLatencyCtx {
  GroupCtx g;                // peers, rank, R, timeout (g.layout unused)
  LowLatencyLayout ll;
  int32_t num_experts;       // E
  int32_t num_local;         // L = E / R
  int32_t hidden;            // H
  int32_t max_tokens;        // T_max
  int32_t sm_count;          // SMs of this device (grid sizing)
};

// Dispatch send: one message per (token, distinct expert) straight into the owner's slot [l][me][position].
struct LowLatencyDispatchSendParams {
  LowLatencyCtx c;
  const void* x;             // [T, H] bf16
  const int32_t* topk_idx;   // [T, K]
  int32_t* token;            // [2] s32 out: (epoch, T) of this op, read by the receive half
  int32_t num_tokens;        // T
  int32_t num_topk;          // K
  bool use_fp8;              // quantize per 128 channels in the kernel (SPEC §4 rule) or send bf16
};

// Dispatch receive: waits for every (local expert, source) signal and packs rows in (source, token) order.
struct LowLatencyDispatchRecvParams {
  LowLatencyCtx c;
  const int32_t* token;      // [2] from the send half
  void* recv_x;              // [L, R*T_max, H] fp8 or bf16 out
  float* recv_x_scales;      // [L, R*T_max, S] f32 out (fp8), else nullptr
  int32_t* recv_count;       // [L] out
  int32_t* src_info;         // [L, R*T_max] out: source token, -1 on rows >= recv_count
  int32_t* layout_range;     // [L, R] out: rows from each source rank
  bool use_fp8;
};

// Combine send: every valid expert row back to its token's rank, slot [global expert][token].
struct LowLatencyCombineSendParams {
  LowLatencyCtx c;
  const void* expert_out;    // [L, R*T_max, H] bf16
  const int32_t* src_info;   // [L, R*T_max] (handle)
  const int32_t* layout_range;  // [L, R] (handle)
  int32_t* token;            // [2] s32 out: (epoch, 0)
};

// Combine receive: y[t] = sum_k w[t, k] * row(topk_idx[t, k], t), f32 accumulation, bf16 out.
struct LowLatencyCombineRecvParams {
  LowLatencyCtx c;
  const int32_t* token;      // [2] from the send half
  const int32_t* topk_idx;   // [T, K]
  const float* topk_weights; // [T, K]
  void* y;                   // [T, H] bf16 out
  int32_t num_tokens;        // T
  int32_t num_topk;          // K
};

}  // namespace jax_ep
