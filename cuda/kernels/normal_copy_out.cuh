// Normal-mode dispatch's copy-out of staging into XLA's outputs (launched by normal_kernels.cu's
// launch_send_wait_copy): recv_copy_kernel after a send and wait, and send_copy_kernel, whose sender blocks send
// (normal_kernels.cu's send_items) while its copier blocks copy out the rows as they land. normal_kernels.cu's header
// comment has the op's sequence.
// NOTE: for the one translation unit of the normal-mode kernels (normal_kernels.cu), after its send kernels: kernels
// with internal linkage.
#pragma once

#include <cstdint>

#include "common/copy.cuh"
#include "common/last_block.cuh"
#include "common/phase_stamps.cuh"
#include "common/ptx.cuh"
#include "common/source_of_row.cuh"
#include "common/thread.cuh"
#include "jax_ep/normal_params.h"
#include "jax_ep/signal_header.h"
#include "kernels/normal_device.cuh"
#include "kernels/normal_phases.cuh"
#include "transport/peer.cuh"

namespace jax_ep::normal {
namespace {

constexpr int kUnroll = 4;  // 16-byte vectors in flight per lane per step (local copy-out)

// ---------------------------------------------------------------------------------------------------------------
// Copy-out (dispatch and cached dispatch through staging): staging rows [0, min(n, C)) into XLA's outputs and the
// padding (0 / -1) of rows [min(n, C), C); by the copier blocks (and joined senders) of send_copy_kernel, or by
// recv_copy_kernel after a send and wait (the NVSHMEM kernels; the NVLink kernels where ranks may mix direct receive
// and staging). Not run with direct receive.
struct RecvArgs {
  GroupCtx g;
  const int32_t* recv_rank_counts;  // [R]
  int32_t capacity;
  char* out_rows;                   // [C, row_bytes]
  int32_t row_bytes;
  float* out_scales;                // [C, scale_cols] or nullptr
  int32_t scale_cols;
  int32_t* out_topk_idx;            // [C, num_weights] or nullptr
  float* out_weights;               // [C, num_weights] or nullptr
  int32_t num_weights;
  int32_t* out_src_idx;             // [C] or nullptr
  int32_t* out_src_rank;            // [C] or nullptr
  // SendArgs::self_rows_from_inputs: this rank's inputs [self_tokens, row_bytes] and [self_tokens, scale_cols]; a
  // row from this rank is input row src_idx (from staging, written by this rank's send). nullptr: staging only.
  const char* self_rows;
  const float* self_scales;
  int32_t self_tokens;
};

// One warp: row `row` of XLA's outputs from staging (a row from this rank itself: payload and scales from its
// inputs), s = the row's source rank; s < 0: a padding row (zeros, ids and source -1, weights 0).
__device__ __forceinline__ void copy_out_row(const RecvArgs& a, int32_t row, int32_t s) {
  const GroupCtx& g = a.g;
  const BufferLayout& B = g.layout;
  const int lane = lane_id();
  const bool valid = s >= 0;
  const char* self = self_base(g);
  const int n16 = a.row_bytes / 16;
  // A row from a remote source (normal mode over NVSHMEM) has its metadata in one record (staging_layout.h).
  const bool meta = valid && g.remote.test(s);
  const char* rec = self + B.remote_meta + static_cast<int64_t>(row) * B.meta_stride;
  const int4* src = reinterpret_cast<const int4*>(self + B.payload + static_cast<int64_t>(row) * a.row_bytes);
  const float* scale_src = reinterpret_cast<const float*>(self + B.scales) + static_cast<int64_t>(row) * a.scale_cols;
  if (valid && s == g.rank && a.self_rows != nullptr) {  // this rank's own row: from the inputs
    // its source index came from this rank's send (stream order, or its arrivals); clamped all the same
    const int32_t t = min(max(__ldcg(reinterpret_cast<const int32_t*>(self + B.src_idx) + row), 0), a.self_tokens - 1);
    src = reinterpret_cast<const int4*>(a.self_rows + static_cast<int64_t>(t) * a.row_bytes);
    if (a.self_scales != nullptr) scale_src = a.self_scales + static_cast<int64_t>(t) * a.scale_cols;
  }
  int4* dst = reinterpret_cast<int4*>(a.out_rows + static_cast<int64_t>(row) * a.row_bytes);
  for (int base = 0; base < n16; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int i = base + j * 32 + lane;
      v[j] = make_int4(0, 0, 0, 0);
      if (valid && i < n16) v[j] = ld_cg_v4(src + i);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int i = base + j * 32 + lane;
      if (i < n16) dst[i] = v[j];
    }
  }
  if (a.out_scales != nullptr) {
    const float* s_src = meta ? reinterpret_cast<const float*>(rec + 4 * (2 * B.meta_k + 1)) : scale_src;
    for (int j = lane; j < a.scale_cols; j += 32)
      a.out_scales[static_cast<int64_t>(row) * a.scale_cols + j] = valid ? __ldcg(s_src + j) : 0.0f;
  }
  if (lane < a.num_weights) {
    const int64_t at = static_cast<int64_t>(row) * a.num_weights + lane;
    const int32_t* ids = meta ? reinterpret_cast<const int32_t*>(rec + 4 * B.meta_k) + lane
                              : reinterpret_cast<const int32_t*>(self + B.topk_idx) + at;
    const float* ws = meta ? reinterpret_cast<const float*>(rec) + lane
                           : reinterpret_cast<const float*>(self + B.topk_weights) + at;
    if (a.out_topk_idx != nullptr) a.out_topk_idx[at] = valid ? __ldcg(ids) : -1;
    if (a.out_weights != nullptr) a.out_weights[at] = valid ? __ldcg(ws) : 0.0f;
  }
  if (lane == 0 && a.out_src_idx != nullptr) {
    const int32_t* si = meta ? reinterpret_cast<const int32_t*>(rec + 8 * B.meta_k)
                             : reinterpret_cast<const int32_t*>(self + B.src_idx) + row;
    a.out_src_idx[row] = valid ? __ldcg(si) : -1;
  }
  if (lane == 0 && a.out_src_rank != nullptr) a.out_src_rank[row] = s;
}

// The rows [prefix[s], prefix[s + 1]) of staging come from rank s (the exchanged counts); s_prefix: R + 1 entries of
// the caller's shared memory. Every thread.
__device__ __forceinline__ void load_row_prefix(const RecvArgs& a, int32_t* s_prefix) {
  for (int s = threadIdx.x; s < a.g.num_ranks; s += blockDim.x) s_prefix[s + 1] = a.recv_rank_counts[s];  // at once
  __syncthreads();
  if (threadIdx.x == 0) {
    s_prefix[0] = 0;
    for (int s = 0; s < a.g.num_ranks; ++s) s_prefix[s + 1] += s_prefix[s];
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kCopyThreads) recv_copy_kernel(const __grid_constant__ RecvArgs a) {
  __shared__ int32_t s_prefix[kMaxGroupRanks + 1];
  load_row_prefix(a, s_prefix);
  const int R = a.g.num_ranks;
  const int32_t valid_rows = min(s_prefix[R], a.capacity);
  for (int row = global_warp(); row < a.capacity; row += num_global_warps())
    copy_out_row(a, row, row < valid_rows ? source_of_row(s_prefix, R, row) : -1);
}

// The rows of chunk c (cr rows each) of a source's rows here that its senders store: those below the capacity. The
// senders count every row from (kArrivalChunks - 1) cr on in the last chunk, so the last chunk expects them all.
__device__ __forceinline__ uint32_t staged_chunk_rows(int32_t first_row, int32_t n, int32_t capacity, int c, int cr) {
  // rows [c cr, min((c + 1) cr, n)) of a source whose rows start at staging row first_row (the last chunk: up to n),
  // cut at the capacity
  const int32_t begin = c * cr, end = min(c == kArrivalChunks - 1 ? n : min(begin + cr, n), capacity - first_row);
  return end > begin ? static_cast<uint32_t>(end - begin) : 0u;
}

// Dispatch through staging on the NVLink kernels when every rank of the group stages (a group across processes, cached
// dispatch), one kernel: `senders` blocks send (send_items, each row counted in its destination's arrivals), the other
// blocks (and each sender once done) copy staging into XLA's outputs as the rows land, so the copy-out runs under the
// sends instead of after them. Every rank must run it: a peer's send_rows_kernel does not count its rows.
//
// Copiers: items (next_item on kNextReceiveItem) are first the padding rows [received, capacity), then the received
// rows, interleaved over the sources (item j -> source (me + j) % R, its row j / R), so each source's rows are taken
// in the order its senders store them. A warp waits (lane 0, acquire at system scope, kArrivalBackoffNs between
// reads) until the row's chunk holds every row of it below the capacity (staged_chunk_rows), then copies the row. A
// sender block joins the copiers once its sends are done and every sender has started, taking only items past their
// static first round.
// The last sender block signals kDataFlag (its release cumulative over every sender's stores through the GPU-scope
// tickets of kSendBlocksDone); the last block of the grid puts the receiving item counter, the role ticket and this
// op's arrival counters back to 0: every chunk with a row below the capacity was waited for complete, a chunk
// without one gets no add, and no peer adds again before this rank's next count signal or barrier.
//
// NOTE (progress): copiers spin, as push combine's reducers do (normal_combine.cuh): roles go by start order (the first
// `senders` blocks to start send), so a block that spins has seen every sender start; a sender spins only once its
// sends are done and every sender has started (every_sender_started); senders never wait for anything before, so every
// chunk waited for completes. The grid is one wave of at most senders + max(2 senders, 24) blocks: at the default
// num_sms 72 of an H100's 132 SMs, so kernels on other streams of this GPU still find SMs while the copiers wait (with
// num_sms of a third of the SMs or more the grid holds them all, as push combine's does).
__global__ void __launch_bounds__(kSendThreads, 1) send_copy_kernel(const __grid_constant__ SendArgs a,
                                                                    const __grid_constant__ RecvArgs r, int senders) {
  __shared__ int32_t s_prefix[kMaxGroupRanks + 1];
  __shared__ int32_t s_role, s_last, s_join;
  const GroupCtx& g = a.g;
  char* self = self_base(g);
  phase_begin(g_normal_phases);
  const uint32_t epoch = current_epoch(g);
  if (threadIdx.x == 0) s_role = static_cast<int32_t>(atomicAdd(header_word(self, SignalHeader::kRoleTicket), 1u));
  load_row_prefix(r, s_prefix);  // its __syncthreads also publishes s_role
  const int role = s_role, R = g.num_ranks, me = g.rank, cr = a.arrival_chunk_rows;
  const int32_t received = min(s_prefix[R], r.capacity);
  if (role < senders) {
    send_items(a, ItemQueue{header_word(self, SignalHeader::kNextItem), senders, role}, nullptr, 0);
    __syncthreads();
    phase_stamp(g_normal_phases, kPhaseSendBlockDone);
    if (last_block<TicketScope::kGpu>(header_word(self, SignalHeader::kSendBlocksDone), &s_last,
                                      static_cast<uint32_t>(senders))) {
      if (threadIdx.x == 0) *header_word(self, SignalHeader::kNextItem) = 0u;
      for (int d = threadIdx.x; d < R; d += blockDim.x) signal_peer(g, d, SignalHeader::kDataFlag, epoch);
      phase_stamp(g_normal_phases, kPhaseSendLastBlockDone);
    }
  }
  // Copiers from the start; a sender block, once its sends are done and every sender has started, takes the items
  // past the copiers' static first round
  int32_t span = 0;
  for (int s = 0; s < R; ++s) span = max(span, s_prefix[s + 1] - s_prefix[s]);
  const int64_t pad = r.capacity - received, items = pad + static_cast<int64_t>(R) * span;
  const bool copier = role >= senders;
  const ItemQueue q{header_word(self, SignalHeader::kNextReceiveItem), static_cast<int>(gridDim.x) - senders,
                    copier ? role - senders : 0};
  const bool joins = copier || every_sender_started(self, senders, &s_join);
  for (int64_t i = !joins ? items : copier ? first_item(q) : next_item(q, items); i < items; i = next_item(q, items)) {
    if (i < pad) {
      copy_out_row(r, received + static_cast<int32_t>(i), -1);
      continue;
    }
    const int s = static_cast<int>((me + (i - pad) % R) % R);
    const int32_t k = static_cast<int32_t>((i - pad) / R), first = s_prefix[s], n = s_prefix[s + 1] - first;
    if (k >= n || first + k >= r.capacity) continue;
    const int c = min(k / cr, kArrivalChunks - 1);
    if (lane_id() == 0)
      wait_reached(row_arrivals(self, s, c), staged_chunk_rows(first, n, r.capacity, c, cr), g.timeout_ns,
                   "dispatch (rows from peers)", me, s, kArrivalBackoffNs);
    __syncwarp();  // orders lane 0's acquire before every lane's loads of the row
    copy_out_row(r, first + k, s);
  }
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseCopyBlockDone);
  if (!last_block<TicketScope::kGpu>(header_word(self, SignalHeader::kBlockDone), &s_last)) return;
  if (threadIdx.x == 0) {
    *header_word(self, SignalHeader::kNextReceiveItem) = 0u;
    *header_word(self, SignalHeader::kRoleTicket) = 0u;
  }
  for (int i = threadIdx.x; i < R * kArrivalChunks; i += blockDim.x)
    *row_arrivals(self, i / kArrivalChunks, i % kArrivalChunks) = 0u;
  phase_stamp(g_normal_phases, kPhaseCopyLastBlockDone);
}

}  // namespace
}  // namespace jax_ep::normal
