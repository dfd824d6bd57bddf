// Normal mode (training, prefill): POD parameters of dispatch, cached dispatch and combine. Handlers fill them;
// kernels read them by value. Every pointer is annotated with its shape and dtype (names of docs/API.md).
#pragma once

#include <cstdint>

#include "jax_ep/group_ctx.h"
#include "jax_ep/signal_header.h"

namespace jax_ep::normal {

// Direct receive (one process, NVLink kernels): a receiver's dispatch outputs as every device of the process
// addresses them. Each dispatch's notify writes its own into every rank's recv_targets[me] before the count signal;
// senders then store rows, scales, ids, weights, source index and source rank straight into these buffers instead
// of the receiver's staging, and the receiver's own send kernel writes its padding rows (SendArgs::pad; no copy-out
// runs). rows == nullptr: this receiver takes its rows through staging (its outputs are not peer-addressable, or the
// path is off).
struct alignas(16) RecvTargets {
  char* rows;          // recv_x [C, row_bytes]
  float* scales;       // recv_x_scales [C, S], nullptr for bf16
  int32_t* topk_idx;   // recv_topk_idx [C, K]
  float* weights;      // recv_topk_weights [C, K]
  int32_t* src_idx;    // recv_src_idx [C]
  int32_t* src_rank;   // recv_src_rank [C]
  int64_t unused[2];
};
static_assert(sizeof(RecvTargets) == kRecvTargetBytes, "one RecvTargets per rank in BufferLayout::recv_targets");

// Pull combine (one process, NVLink kernels): a rank's combine inputs as every device of the process addresses them.
// Each combine's first kernel writes its own into every rank's SignalHeader::kCombineSources[epoch & 1][me] before
// the op's barrier. When every rank of the group published (values != nullptr), each rank reads its tokens' terms
// straight from the peers' values and weights (no send, no staging) and then tells every rank it is done reading;
// otherwise every rank sends its rows back into the sources' staging. No rank writes the op's table after its
// barrier (signal_header.h: by parity), so every kernel of every rank reads the same table and the ranks agree on
// the mode.
struct alignas(16) CombineSource {
  const char* values;    // values [C, W], nullptr: not published (this rank's inputs are not peer-addressable)
  const float* weights;  // weights [C, Kw], nullptr when Kw == 0
};
static_assert(sizeof(CombineSource) == SignalHeader::kCombineSourceBytes, "one entry of kCombineSources");

// Dispatch: layout + count exchange + direct-addressed row writes + local copy-out.
struct DispatchParams {
  GroupCtx g;
  const void* x;                        // [T, H] bf16 or f8e4m3fn, row_bytes per row
  const float* x_scales;                // [T, S] f32, S = H/128 (fp8), else nullptr
  const int32_t* topk_idx;              // [T, K] s32
  const float* topk_weights;            // [T, K] f32
  void* recv_x;                         // [C, H] x dtype out
  float* recv_x_scales;                 // [C, S] f32 out (fp8), else nullptr
  int32_t* recv_topk_idx;               // [C, K] s32 out
  float* recv_topk_weights;             // [C, K] f32 out
  int32_t* num_recv_tokens;             // [] s32 out
  int32_t* num_recv_tokens_per_expert;  // [L] s32 out
  int32_t* send_pos;                    // [T, R] s32 out (handle)
  int32_t* recv_src_idx;                // [C] s32 out (handle)
  int32_t* recv_src_rank;               // [C] s32 out (handle)
  int32_t* recv_rank_counts;            // [R] s32 out (handle)
  int32_t* send_row_offset;             // [R] s32 out (handle)
  int32_t num_tokens;                   // T
  int32_t num_topk;                     // K
  int32_t num_experts;                  // E
  int32_t capacity;                     // C
  int32_t max_tokens_per_rank;          // T_max of the config (every rank's): at most this many rows per source
  int32_t row_bytes;                    // H * sizeof(x dtype), multiple of 16
  int32_t scale_cols;                   // S (0 for bf16)
  int32_t num_sms;                      // blocks of the NVLink-sending kernel
  int32_t copy_blocks;                  // blocks of the local copy-out kernel
  bool direct_receive;                  // publish the outputs as this rank's RecvTargets (NVLink kernels only)
  // Direct receive with one process per GPU: destination d addresses this rank's outputs at their address plus
  // receive_delta[d] (its mapping of this rank's receive pool); 0 in one process, where every device shares them.
  int64_t receive_delta[kMaxNvlPeers];
  // Every rank of the group receives this op through staging (its ranks are in different processes without receive
  // pools): the NVLink kernels then copy out under the send (send_copy_kernel). false: each rank decides for itself
  // whether it takes direct receive (one process, or receive pools across processes), so a group may mix both ways;
  // a rank through staging then runs the send kernel (which reads every destination's RecvTargets), the wait and the
  // copy-out after them.
  bool every_rank_staged;
};

// Cached dispatch: rows along the routes of an earlier dispatch's handle (no count exchange).
struct CachedDispatchParams {
  GroupCtx g;
  const void* payload;                  // [T, W] bf16 or f32, row_bytes per row
  const float* weights;                 // [T, Kw] f32, nullptr when Kw == 0
  const int32_t* send_pos;              // [T, R] s32 (handle)
  const int32_t* recv_rank_counts;      // [R] s32 (handle)
  const int32_t* send_row_offset;       // [R] s32 (handle)
  void* recv;                           // [C, W] out
  float* recv_weights;                  // [C, Kw] f32 out, nullptr when Kw == 0
  int32_t num_tokens;                   // T
  int32_t num_weights;                  // Kw (0 or K)
  int32_t capacity;                     // C
  int32_t max_tokens_per_rank;          // T_max of the config (every rank's): at most this many rows per source
  int32_t row_bytes;                    // W * sizeof(payload dtype), multiple of 16
  int32_t num_sms;
  int32_t copy_blocks;
};

enum class CombineDtype : int32_t { kBF16 = 0, kF32 = 1 };

// Combine: each received row goes back to its source into slot [this rank][token]; the source sums in f32.
struct CombineParams {
  GroupCtx g;
  const void* values;                   // [C, W] bf16 or f32
  const float* weights;                 // [C, Kw] f32, nullptr when Kw == 0
  const int32_t* send_pos;              // [T, R] s32 (handle)
  const int32_t* recv_src_idx;          // [C] s32 (handle)
  const int32_t* recv_src_rank;         // [C] s32 (handle)
  const int32_t* recv_rank_counts;      // [R] s32 (handle)
  const int32_t* send_row_offset;       // [R] s32 (handle)
  void* y;                              // [T, W] values dtype out
  float* y_weights;                     // [T, Kw] f32 out, nullptr when Kw == 0
  CombineDtype dtype;
  int32_t num_tokens;                   // T
  int32_t max_tokens_per_rank;          // T_max: slot stride per source rank in the staging
  int32_t num_weights;                  // Kw
  int32_t capacity;                     // C
  int32_t row_bytes;                    // W * sizeof(dtype), multiple of 16
  int32_t num_sms;
  int32_t copy_blocks;
  bool publish;      // publish values / weights as this rank's CombineSource (they are peer-addressable)
  bool pull_table;   // NVLink kernels: the combine_sources table is written this op (the mode is read from it)
};

// The row-sending step shared by dispatch and cached dispatch (after the count exchange, or the barrier): one warp
// per token stores (or, to a remote rank, puts) its row, scales, top-k ids and weights and source index into the
// staging row send_row_offset[d] + send_pos[t, d] of every destination d. Also the NVSHMEM module's entry point
// (jax_ep/nvshmem_ops.h), so it lives here rather than in the kernels' TU.
struct SendArgs {
  GroupCtx g;
  const char* rows;                // [T, row_bytes]
  const float* scales;             // [T, scale_cols] or nullptr
  const int32_t* topk_idx;         // [T, K] (dispatch: converted to the destination's local ids) or nullptr
  const float* weights;            // [T, num_weights] or nullptr
  const int32_t* send_pos;         // [T, R]
  const int32_t* send_row_offset;  // [R]
  int32_t num_tokens;
  int32_t row_bytes;
  int32_t scale_cols;
  int32_t num_weights;             // K (dispatch) or Kw (cached)
  int32_t capacity;
  int32_t experts_per_rank;        // L (dispatch)
  bool write_src_idx;              // dispatch: the source token index of every row
  // Dispatch on the NVLink path: send_pos as written by notify (positions within each notify chunk, to which the
  // send adds the chunk's first position per rank from the notify scratch and stores the result back: the handle's
  // send_pos); nullptr: send_pos is final (cached dispatch, the NVSHMEM kernels, a single notify block).
  int32_t* chunked_send_pos;
  int32_t chunk_tokens;            // notify_chunk_tokens(num_tokens) with chunked_send_pos
  bool direct;                     // dispatch (NVLink kernels): destinations' RecvTargets are published this op
  // Dispatch through staging on the NVLink path: the copy-out reads this rank's own rows (payload and scales) from
  // the inputs (RecvArgs::self_rows), so the send stores only their top-k ids, weights and source index into its own
  // staging: the send's SMs store (R-1)/R of the bytes instead of all of them.
  bool self_rows_from_inputs;
  // Dispatch through staging on the NVLink path with the copy-out under the send (send_copy_kernel): each stored row
  // is counted in its destination's arrivals (signal_header.h kRowArrivals), chunks of this many of the rows one rank
  // sends one destination (arrival_chunk_rows(min(T_max, capacity)): a source's rows below the capacity number at
  // most that); 0: not counted.
  int32_t arrival_chunk_rows;
  // Dispatch with direct receive on the NVLink path: this rank's own outputs, whose padding rows
  // [min(received, capacity), capacity) the send kernel writes as work items after the tokens (so no copy-out pass
  // runs); rows nullptr: the copy-out kernel writes the padding.
  struct Padding {
    char* rows;                       // [C, row_bytes]
    float* scales;                    // [C, scale_cols] or nullptr
    int32_t* topk_idx;                // [C, num_weights] or nullptr
    float* weights;                   // [C, num_weights] or nullptr
    int32_t* src_idx;                 // [C] or nullptr
    int32_t* src_rank;                // [C] or nullptr
    const int32_t* recv_rank_counts;  // [R], written by notify
  } pad;
};

}  // namespace jax_ep::normal
