// Normal mode (training, prefill): dispatch / cached dispatch / combine between the GPUs of a group over NVLink
// (peer pointers from either process model, cuda/transport/peer.cuh).
//
// Dispatch:  layout + count exchange -> direct-addressed row writes -> per-destination completion signal -> local
//            copy-out of staging into XLA's outputs (this rank's own rows from its inputs), or with direct receive
//            (one process, RecvTargets) row writes straight into the destination's outputs, the padding rows written
//            by the send kernel after its tokens. A group across processes (every rank through staging) runs the
//            row writes and the copy-out as one kernel: the copy-out of each row once it has landed.
// Combine:   publish + barrier -> push mode: one kernel, rows back into the sources' staging (counted per chunk
//            of rows) while other blocks of it reduce from staging each token whose rows are in;
//            pull mode (one process, every rank published its CombineSource): reduce reading the peers' inputs,
//            then "done reading" signals.
// Cached dispatch: barrier -> row writes into staging with the copy-out under them (one kernel) -> signal.
// Rows are written at fixed positions known after the count exchange (send_row_offset[d] + send_pos[t, d]), so
// there are no ring queues and no head/tail handshakes; rows beyond the capacity are never written.
// Where XLA's buffers are not addressable by the peers (one process per GPU, other allocators: xla_ffi/
// direct_buffers.h) the staging path serves; it moves the same bytes over NVLink plus one local pass (under the
// sends where every rank of the group stages).
#include <cuda_bf16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "common/copy.cuh"
#include "common/phase_stamps.cuh"
#include "common/preload.cuh"
#include "common/ptx.cuh"
#include "common/layout.cuh"
#include "common/thread.cuh"
#include "jax_ep/api.h"
#include "jax_ep/nvshmem_ops.h"
#include "kernels/normal_device.cuh"
#include "kernels/normal_phases.cuh"
#include "jax_ep/signal_header.h"
#include "transport/peer.cuh"

namespace jax_ep::normal {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Barrier kernel (cached dispatch, combine, group warm-up).
__global__ void __launch_bounds__(32, 1) barrier_kernel(const __grid_constant__ GroupCtx g) { group_barrier_block(g, "barrier"); }

// Waits until every rank has signalled that its send of this op has ended (all its rows are in this rank's staging
// or outputs).
// NOTE: waiting happens in one-warp kernels like this one, never inside a wide kernel, except in the receiving
// blocks of the two-role kernels and their senders once done (send_copy_kernel, combine_push_kernel: their NOTEs): a
// grid of spinning blocks could starve kernels on other streams of this GPU (e.g. an NCCL collective of the same
// program) that a peer is waiting for, and deadlock the group.
__global__ void __launch_bounds__(32, 1) wait_data_kernel(const __grid_constant__ GroupCtx g) {
  const uint32_t epoch = current_epoch(g);
  for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x)
    wait_peer(g, s, SignalHeader::kDataFlag, epoch, "receive (data from peers)");
}

// u32 word j of this rank's RecvTargets as rank d addresses them (receive_delta[d]); all zero when its rows go through
// staging. Field by field, so no RecvTargets is built in local memory.
__device__ __forceinline__ uint32_t recv_target_word(const DispatchParams& p, int d, int j) {
  static_assert(sizeof(RecvTargets) == 8 * 8 && offsetof(RecvTargets, src_rank) == 5 * 8, "six pointers, then unused");
  const void* q = nullptr;
  if (p.direct_receive) {
    switch (j / 2) {
      case 0: q = p.recv_x; break;
      case 1: q = p.recv_x_scales; break;
      case 2: q = p.recv_topk_idx; break;
      case 3: q = p.recv_topk_weights; break;
      case 4: q = p.recv_src_idx; break;
      case 5: q = p.recv_src_rank; break;
      default: break;
    }
  }
  const uint64_t at = q == nullptr ? 0 : reinterpret_cast<uint64_t>(q) + (d < kMaxNvlPeers ? p.receive_delta[d] : 0);
  return static_cast<uint32_t>(j % 2 == 0 ? at : at >> 32);
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch step 1: layout + send_pos, count exchange, handle counts. Block b lays out chunk b of the tokens
// (notify_chunk_tokens each) with send_pos relative to the chunk; the last block to finish adds up the chunks (the
// per-rank prefix over chunks goes to the notify scratch, for the send kernel to complete send_pos), then does the
// exchange alone, so only one block ever waits for peers.
// NOTE (no barrier): the count exchange is this op's only rendezvous. The only region this kernel writes into a peer
// (count_words) is read by that peer only in its notify kernel, which ends before its data signal, and lies below
// the rows of every config sharing the staging (staging_layout.h: the peer-written window ends at one offset for
// every E). This rank waited for that signal of the previous dispatch (wait_data_kernel), and any other op in between
// (combine, cached dispatch) has a barrier of its own. Staging rows are written only by the send that follows, after
// this rank has seen every peer's count words of this op, which each peer stored after all of its earlier kernels
// had ended (stream order): every peer has finished its earlier ops. The arrival counts (kBarrierIn) are still
// raised, without waiting, so later barriers keep counting ops.
__global__ void __launch_bounds__(kNotifyThreads, 1) dispatch_notify_kernel(const __grid_constant__ DispatchParams p) {
  __shared__ layout::TileSmem<kNotifyThreads> sm;
  __shared__ int32_t s_last;
  // the handle counts, added up as the count words arrive (R <= kMaxNvlPeers on this path)
  __shared__ int32_t s_recv[kMaxNvlPeers], s_row_offset[kMaxNvlPeers], s_total;
  extern __shared__ int32_t s_expert[];  // [E] this rank's expert counts; in the exchange, [L] received per expert
  const GroupCtx& g = p.g;
  const int tid = threadIdx.x, R = g.num_ranks, me = g.rank, L = p.num_experts / R, E = p.num_experts;
  char* self = self_base(g);
  int32_t* chunk_counts = reinterpret_cast<int32_t*>(self + g.layout.notify_scratch);  // [kMaxNotifyBlocks][R]
  int32_t* chunk_experts = chunk_counts + kMaxNotifyBlocks * R;                         // [kMaxNotifyBlocks][E]
  phase_begin(g_normal_phases);

  const layout::Params lp = notify_layout_params(p);
  const int chunk = notify_chunk_tokens(p.num_tokens);
  const int begin = static_cast<int>(blockIdx.x) * chunk;
  const int end = min(p.num_tokens, begin + chunk);
  if (tid < kMaxNvlPeers) s_row_offset[tid] = 0;  // ordered before the exchange by the layout's barriers
  if (tid == 0) s_total = 0;
  layout::clear_layout_counts<kNotifyThreads>(lp, sm, s_expert);
  phase_stamp(g_normal_phases, kPhaseNotifyCleared);
  layout::range_layout<kNotifyThreads>(lp, begin, end, sm, s_expert);
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseNotifyChunk);
  if (gridDim.x > 1) {
    for (int r = tid; r < R; r += blockDim.x) chunk_counts[blockIdx.x * R + r] = sm.rank_base[r];
    for (int e = tid; e < E; e += blockDim.x) chunk_experts[blockIdx.x * E + e] = s_expert[e];
    // the last block reads every block's chunk counts (GPU-scope tickets order them)
    if (!last_block<TicketScope::kGpu>(header_word(self, SignalHeader::kBlockDone), &s_last)) return;
    // Every chunk's value is loaded before any is used (unrolled over kMaxNotifyBlocks, one L2 round trip), then
    // chunk counts -> each chunk's first position; the rank totals; the expert totals.
    const int chunks = static_cast<int>(gridDim.x);
    for (int r = tid; r < R; r += blockDim.x) {
      int32_t n[kMaxNotifyBlocks];
#pragma unroll
      for (int c = 0; c < kMaxNotifyBlocks; ++c) n[c] = c < chunks ? __ldcg(chunk_counts + c * R + r) : 0;
      int32_t running = 0;
#pragma unroll
      for (int c = 0; c < kMaxNotifyBlocks; ++c) {
        if (c < chunks) chunk_counts[c * R + r] = running;
        running += n[c];
      }
      sm.rank_base[r] = running;
    }
    for (int e = tid; e < E; e += blockDim.x) {
      int32_t n = 0;
#pragma unroll
      for (int c = 0; c < kMaxNotifyBlocks; ++c) n += c < chunks ? __ldcg(chunk_experts + c * E + e) : 0;
      s_expert[e] = n;
    }
    __syncthreads();
  }
  phase_stamp(g_normal_phases, kPhaseNotifyLayout);

  const uint32_t epoch = group_arrive_block(g, false);
  phase_stamp(g_normal_phases, kPhaseNotifyArrived);

  // The count exchange: every value this rank sends rank d is one epoch word (this op's epoch, the value) in d's
  // count_words[me]: this rank's row of the count matrix, its per-expert counts of d's experts, its receive targets
  // as d addresses them (zero when its rows go through staging). Each word is valid on its own, so no fence or
  // signal follows the stores; d waits for every word of this epoch, adds the counts up in shared memory into its
  // handle counts (notify_outputs' sums, without a pass over global memory) and copies the receive targets where the
  // send kernel reads them.
  const int words = static_cast<int>(count_words_per_rank(R, L));
  for (int i = tid; i < R * words; i += blockDim.x) {
    const int d = i / words, w = i % words;
    uint32_t v;
    if (w < R) {
      v = static_cast<uint32_t>(sm.rank_base[w]);
    } else if (w < R + L) {
      v = static_cast<uint32_t>(s_expert[d * L + w - R]);
    } else {
      v = recv_target_word(p, d, w - R - L);
    }
    uint64_t* box = reinterpret_cast<uint64_t*>(peer_base(g, d) + g.layout.count_words);
    st_relaxed_sys_u64(box + static_cast<int64_t>(me) * words + w, epoch_word(epoch, v));
  }
  phase_stamp(g_normal_phases, kPhaseNotifyPublished);
  __syncthreads();  // every read of s_expert above is done: its first L entries now count received tokens
  int32_t* s_recv_expert = s_expert;
  for (int l = tid; l < L; l += blockDim.x) s_recv_expert[l] = 0;
  __syncthreads();
  const uint64_t* box = reinterpret_cast<const uint64_t*>(self + g.layout.count_words);
  uint32_t* targets = reinterpret_cast<uint32_t*>(self + g.layout.recv_targets);
  for (int i = tid; i < R * words; i += blockDim.x) {
    const int s = i / words, w = i % words;  // word w of source s
    const auto v = static_cast<uint32_t>(
        wait_word_reached(box + i, epoch, g.timeout_ns, "dispatch count exchange", me, s));
    if (w < R) {  // counts[s][w]: s sends rank w that many rows
      if (w == me) {
        s_recv[s] = static_cast<int32_t>(v);
        atomicAdd(&s_total, static_cast<int32_t>(v));
      }
      if (s < me) atomicAdd(&s_row_offset[w], static_cast<int32_t>(v));  // ranks before this one come first at w
    } else if (w < R + L) {
      atomicAdd(&s_recv_expert[w - R], static_cast<int32_t>(v));
    } else {
      targets[s * kRecvTargetWords + w - R - L] = v;
    }
  }
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseNotifyExchanged);

  for (int d = tid; d < R; d += blockDim.x) {
    p.recv_rank_counts[d] = s_recv[d];
    p.send_row_offset[d] = s_row_offset[d];
  }
  if (tid == 0) *p.num_recv_tokens = s_total;
  for (int l = tid; l < L; l += blockDim.x) p.num_recv_tokens_per_expert[l] = s_recv_expert[l];
  phase_stamp(g_normal_phases, kPhaseNotifyOutputs);
}

// ---------------------------------------------------------------------------------------------------------------
// One warp: padding row `row` of this rank's outputs (a.pad): zeros, top-k ids and source -1, weights 0.
__device__ __forceinline__ void store_padding_row(const SendArgs& a, int32_t row) {
  const int lane = lane_id(), n16 = a.row_bytes / 16;
  int4* dst = reinterpret_cast<int4*>(a.pad.rows + static_cast<int64_t>(row) * a.row_bytes);
  for (int i = lane; i < n16; i += 32) st_v4(dst + i, make_int4(0, 0, 0, 0));
  if (a.pad.scales != nullptr)
    for (int j = lane; j < a.scale_cols; j += 32) a.pad.scales[static_cast<int64_t>(row) * a.scale_cols + j] = 0.0f;
  if (lane < a.num_weights) {
    const int64_t at = static_cast<int64_t>(row) * a.num_weights + lane;
    if (a.pad.topk_idx != nullptr) a.pad.topk_idx[at] = -1;
    if (a.pad.weights != nullptr) a.pad.weights[at] = 0.0f;
  }
  if (lane == 0 && a.pad.src_idx != nullptr) a.pad.src_idx[row] = -1;
  if (lane == 0 && a.pad.src_rank != nullptr) a.pad.src_rank[row] = -1;
}

// Dispatch through staging with copiers (send_copy_kernel, a.arrival_chunk_rows > 0): after a warp's stores of a
// token, lane d adds 1 to the arrivals of (this rank, chunk of the row) at destination d: a release at system scope,
// cumulative over every lane's stores through the __syncwarp. rows: token_rows of first = 0.
template <int kSlots>
__device__ __forceinline__ void count_token_rows(const SendArgs& a, const int32_t* rows) {
  __syncwarp();
  const int lane = lane_id();
  int32_t row = -1;
#pragma unroll
  for (int d = 0; d < kSlots; ++d)
    if (lane == d) row = rows[d];
  if (row < 0) return;
  // a source's rows below the capacity number at most min(T_max, capacity) (SendArgs): the chunk is below
  // kArrivalChunks (clamped all the same)
  const int c = min((row - __ldg(a.send_row_offset + lane)) / a.arrival_chunk_rows, kArrivalChunks - 1);
  red_add_release_sys(row_arrivals(peer_base(a.g, lane), a.g.rank, c), 1u);
}

// Row sending (dispatch and cached dispatch): work items (next_item of q) are the tokens, one warp each, 16-byte
// vectors each loaded once and stored to every destination of the token (normal_device.cuh), then with a.pad this
// rank's padding rows [received, capacity). With targets (a.direct), a destination that published its outputs
// (RecvTargets::rows != nullptr) gets its rows there.
__device__ __forceinline__ void send_items(const SendArgs& a, const ItemQueue& q, const RecvTargets* targets,
                                           int32_t received) {
  const int items = a.num_tokens + (a.pad.rows != nullptr ? a.capacity - received : 0);
  for (int i = first_item(q); i < items; i = static_cast<int>(next_item(q, items))) {
    if (i >= a.num_tokens) {
      store_padding_row(a, received + (i - a.num_tokens));
      continue;
    }
    int32_t rows[kMaxNvlPeers];
    token_rows<kMaxNvlPeers>(a, i, 0, rows);
    store_token<kMaxNvlPeers>(a, i, 0, rows, targets);
    if (a.arrival_chunk_rows > 0) count_token_rows<kMaxNvlPeers>(a, rows);
  }
}

__global__ void __launch_bounds__(kSendThreads, 1) send_rows_kernel(const __grid_constant__ SendArgs a) {
  // the NVLink path runs for R <= kMaxNvlPeers only (OpState::validate)
  __shared__ RecvTargets s_targets[kMaxNvlPeers];
  __shared__ int32_t s_received;                  // rows this rank receives, cut by the capacity (with a.pad)
  phase_begin(g_normal_phases);
  const uint32_t epoch = current_epoch(a.g);
  if (a.direct) {
    // written by the peers before their count signals, which this op's notify waited for
    const char* self = self_base(a.g);
    for (int d = threadIdx.x; d < a.g.num_ranks; d += blockDim.x)
      load_recv_targets(self + a.g.layout.recv_targets + d * kRecvTargetBytes, &s_targets[d]);
  }
  if (threadIdx.x == 0 && a.pad.rows != nullptr)
    s_received = min(sum_strided_cg(a.pad.recv_rank_counts, a.g.num_ranks, 1), a.capacity);
  __syncthreads();
  send_items(a, grid_items(a.g), a.direct ? s_targets : nullptr, a.pad.rows != nullptr ? s_received : 0);
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseSendBlockDone);
  if (finish_and_signal_data(a.g, epoch)) phase_stamp(g_normal_phases, kPhaseSendLastBlockDone);
}

}  // namespace
}  // namespace jax_ep::normal

#include "kernels/normal_copy_out.cuh"  // the copy-out kernels and the combine kernels, here to keep the kernels'
#include "kernels/normal_combine.cuh"   // order in this file

namespace jax_ep::normal {
namespace {

int clamp_blocks(int n) { return n < 1 ? 1 : (n > 4096 ? 4096 : n); }

// At most the blocks of `kernel` (`threads` per block) resident at once on the current device, and at least 1: a
// kernel that takes items (next_item) runs as one wave, since a block that starts after others have taken every
// item leaves its own first-round item to a late tail. Occupancy is asked once per (device, kernel).
int one_wave(const void* kernel, int threads, int blocks) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, int> resident;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return clamp_blocks(blocks);
  int n = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = resident.find({dev, kernel});
    if (it != resident.end()) {
      n = it->second;
    } else {
      int sms = 0, per_sm = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess)
        return clamp_blocks(blocks);  // the launch reports what failed
      n = resident[{dev, kernel}] = sms * per_sm;
    }
  }
  const int c = clamp_blocks(blocks);
  return n > 0 && n < c ? n : c;
}

// The NVSHMEM kernels of a group with remote ranks (GroupCtx::remote != 0: EPConfig.normal_over_nvshmem), or
// nullptr for the NVLink kernels. Error: remote ranks but the NVSHMEM module has not handed its table over.
Status transport_ops(const GroupCtx& g, const NormalNvshmemOps** ops) {
  *ops = nullptr;
  if (!g.remote.any()) return Status::Ok();
  *ops = normal_nvshmem_ops();
  if (*ops == nullptr)
    return Status::Error("this group has ranks reached by NVSHMEM puts (R > num_max_nvl_peers) but the NVSHMEM "
                         "module's normal-mode kernels are not loaded (jax_ep.initialize with one process per GPU "
                         "and a build with NVSHMEM's device library)");
  return Status::Ok();
}

Status from_message(const char* err) { return err == nullptr ? Status::Ok() : Status::Error(err); }

Status launch_barrier_on(const GroupCtx& g, const NormalNvshmemOps* ops, cudaStream_t stream) {
  if (ops != nullptr) return from_message(ops->barrier(g, stream));
  barrier_kernel<<<1, 32, 0, stream>>>(g);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

// Sender blocks and receiving blocks of one kernel (push combine, send_copy_kernel): num_sms senders and
// max(2 num_sms, 24) receiving blocks (they keep up with the rows as they land), within one wave; returns the sender
// blocks.
int two_role_grid(const void* kernel, int num_sms, int* blocks) {
  const int senders = clamp_blocks(num_sms);
  const int receivers = 2 * senders > 24 ? 2 * senders : 24;
  *blocks = one_wave(kernel, kSendThreads, senders + receivers);
  if (*blocks < 2) *blocks = 2;  // one sender and one receiving block at least
  return senders < *blocks / 2 ? senders : *blocks / 2;
}

// The shared tail of dispatch and cached dispatch. NVLink kernels, every rank of the group through staging
// (every_rank_staged: a group across processes without receive pools, or cached dispatch): one kernel pushes the rows
// to the peers and copies them out of this rank's staging as they land (send_copy_kernel), then one warp waits until
// every rank's send has ended (its data signal: the count exchange and barrier of the next op rely on it). Otherwise
// (one process, or receive pools: ranks may mix direct receive and staging; DispatchParams::every_rank_staged) the
// send kernel, the wait, and through staging the copy-out with all SMs; with direct receive the send kernel pads and
// no copy-out runs.
// NVSHMEM kernels: send and wait, then the copy-out with all SMs. Only one-warp kernels and the two-role kernel's
// receiving blocks (and its senders once done) spin.
Status launch_send_wait_copy(SendArgs s, const RecvArgs& r, int num_sms, int copy_blocks,
                             int32_t max_tokens_per_rank, bool every_rank_staged, const NormalNvshmemOps* ops,
                             cudaStream_t stream) {
  if (ops != nullptr) {
    JAX_EP_RETURN_IF_ERROR(from_message(ops->send_and_receive_rows(s, clamp_blocks(num_sms), stream)));
  } else if (every_rank_staged && s.pad.rows == nullptr) {
    int blocks = 0;
    const int senders = two_role_grid(reinterpret_cast<const void*>(send_copy_kernel), num_sms, &blocks);
    s.arrival_chunk_rows = arrival_chunk_rows(max_tokens_per_rank < s.capacity ? max_tokens_per_rank : s.capacity);
    send_copy_kernel<<<blocks, kSendThreads, 0, stream>>>(s, r, senders);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    wait_data_kernel<<<1, 32, 0, stream>>>(r.g);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::Ok();
  } else {
    const int blocks = one_wave(reinterpret_cast<const void*>(send_rows_kernel), kSendThreads, num_sms);
    send_rows_kernel<<<blocks, kSendThreads, 0, stream>>>(s);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    wait_data_kernel<<<1, 32, 0, stream>>>(r.g);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (s.pad.rows != nullptr) return Status::Ok();  // direct receive: the send kernel padded
  }
  recv_copy_kernel<<<clamp_blocks(copy_blocks), kCopyThreads, 0, stream>>>(r);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status preload_kernels() {
  JAX_EP_RETURN_IF_ERROR(normal_phase_devices().arm(g_normal_phases));
  return preload({reinterpret_cast<const void*>(barrier_kernel), reinterpret_cast<const void*>(wait_data_kernel),
                  reinterpret_cast<const void*>(dispatch_notify_kernel), reinterpret_cast<const void*>(send_rows_kernel),
                  reinterpret_cast<const void*>(recv_copy_kernel), reinterpret_cast<const void*>(send_copy_kernel),
                  reinterpret_cast<const void*>(combine_push_kernel<__nv_bfloat16>),
                  reinterpret_cast<const void*>(combine_push_kernel<float>),
                  reinterpret_cast<const void*>(combine_publish_barrier_kernel),
                  reinterpret_cast<const void*>(combine_wait_kernel),
                  reinterpret_cast<const void*>(combine_reduce_kernel<__nv_bfloat16>),
                  reinterpret_cast<const void*>(combine_reduce_kernel<float>)});
}

Status phases(bool reset, std::vector<std::string>* names, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits) {
  static const char* const kNames[] = {"notify: block's counts zeroed", "notify: block's chunk laid out",
                                       "notify: layout done",        "notify: arrivals posted",
                                       "notify: count words stored", "notify: count words read",
                                       "notify: outputs written",    "send rows: block's tokens stored",
                                       "send rows: last block done",
                                       "combine: publish + barrier done",
                                       "push combine: sender block's rows stored",
                                       "reduce: block's items done",
                                       "reduce: last block done",
                                       "copy-out: block's rows done",
                                       "copy-out: last block done"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == kNormalPhases, "one name per NormalPhase");
  ns->clear();
  hits->clear();
  JAX_EP_RETURN_IF_ERROR(normal_phase_devices().read(g_normal_phases, reset, ns, hits));
  names->assign(kNames, kNames + kNormalPhases);
  ns->resize(kNormalPhases);
  hits->resize(kNormalPhases);
  return Status::Ok();
}

Status launch_group_barrier(const GroupCtx& g, cudaStream_t stream) {
  const NormalNvshmemOps* ops = nullptr;
  JAX_EP_RETURN_IF_ERROR(transport_ops(g, &ops));
  return launch_barrier_on(g, ops, stream);
}

Status launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  const NormalNvshmemOps* ops = nullptr;
  JAX_EP_RETURN_IF_ERROR(transport_ops(p.g, &ops));
  int notify_blocks = 1;
  if (ops != nullptr) {
    JAX_EP_RETURN_IF_ERROR(from_message(ops->dispatch_notify(p, stream)));
  } else {
    const size_t smem = sizeof(int32_t) * static_cast<size_t>(p.num_experts);
    notify_blocks = (p.num_tokens + notify_chunk_tokens(p.num_tokens) - 1) / notify_chunk_tokens(p.num_tokens);
    notify_blocks = notify_blocks < 1 ? 1 : notify_blocks;
    dispatch_notify_kernel<<<notify_blocks, kNotifyThreads, smem, stream>>>(p);
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }

  SendArgs s{};
  s.g = p.g;
  s.rows = static_cast<const char*>(p.x);
  s.scales = p.scale_cols > 0 ? p.x_scales : nullptr;
  s.topk_idx = p.topk_idx;
  s.weights = p.topk_weights;
  s.send_pos = p.send_pos;
  s.send_row_offset = p.send_row_offset;
  s.num_tokens = p.num_tokens;
  s.row_bytes = p.row_bytes;
  s.scale_cols = p.scale_cols;
  s.num_weights = p.num_topk;
  s.capacity = p.capacity;
  s.experts_per_rank = p.num_experts / p.g.num_ranks;
  s.write_src_idx = true;
  s.direct = ops == nullptr;  // the NVSHMEM kernels neither publish nor read RecvTargets
  if (notify_blocks > 1) {
    s.chunked_send_pos = p.send_pos;
    s.chunk_tokens = notify_chunk_tokens(p.num_tokens);
  }

  RecvArgs r{};
  r.g = p.g;
  r.recv_rank_counts = p.recv_rank_counts;
  r.capacity = p.capacity;
  r.out_rows = static_cast<char*>(p.recv_x);
  r.row_bytes = p.row_bytes;
  r.out_scales = p.scale_cols > 0 ? p.recv_x_scales : nullptr;
  r.scale_cols = p.scale_cols;
  r.out_topk_idx = p.recv_topk_idx;
  r.out_weights = p.recv_topk_weights;
  r.num_weights = p.num_topk;
  r.out_src_idx = p.recv_src_idx;
  r.out_src_rank = p.recv_src_rank;
  if (ops == nullptr && p.direct_receive) {
    s.pad = {r.out_rows,   r.out_scales,   r.out_topk_idx,      r.out_weights,
             r.out_src_idx, r.out_src_rank, r.recv_rank_counts};
  } else if (ops == nullptr && p.num_tokens > 0) {
    s.self_rows_from_inputs = true;
    r.self_rows = s.rows;
    r.self_scales = s.scales;
    r.self_tokens = p.num_tokens;
  }
  return launch_send_wait_copy(s, r, p.num_sms, p.copy_blocks, p.max_tokens_per_rank, p.every_rank_staged, ops,
                              stream);
}

Status launch_cached_dispatch(const CachedDispatchParams& p, cudaStream_t stream) {
  const NormalNvshmemOps* ops = nullptr;
  JAX_EP_RETURN_IF_ERROR(transport_ops(p.g, &ops));
  JAX_EP_RETURN_IF_ERROR(launch_barrier_on(p.g, ops, stream));
  SendArgs s{};
  s.g = p.g;
  s.rows = static_cast<const char*>(p.payload);
  s.scales = nullptr;
  s.topk_idx = nullptr;
  s.weights = p.num_weights > 0 ? p.weights : nullptr;
  s.send_pos = p.send_pos;
  s.send_row_offset = p.send_row_offset;
  s.num_tokens = p.num_tokens;
  s.row_bytes = p.row_bytes;
  s.scale_cols = 0;
  s.num_weights = p.num_weights;
  s.capacity = p.capacity;
  s.experts_per_rank = 1;
  s.write_src_idx = false;

  RecvArgs r{};
  r.g = p.g;
  r.recv_rank_counts = p.recv_rank_counts;
  r.capacity = p.capacity;
  r.out_rows = static_cast<char*>(p.recv);
  r.row_bytes = p.row_bytes;
  r.out_weights = p.num_weights > 0 ? p.recv_weights : nullptr;
  r.num_weights = p.num_weights;
  // cached dispatch never takes direct receive (s.direct stays false): every rank of the group receives by staging
  return launch_send_wait_copy(s, r, p.num_sms, p.copy_blocks, p.max_tokens_per_rank, true, ops, stream);
}

namespace {

template <typename Elem>
Status launch_combine_nvlink(const CombineParams& p, cudaStream_t stream) {
  const void* push = reinterpret_cast<const void*>(combine_push_kernel<Elem>);
  const void* reduce = reinterpret_cast<const void*>(combine_reduce_kernel<Elem>);
  int blocks = 0;
  const int senders = two_role_grid(push, p.num_sms, &blocks);
  combine_publish_barrier_kernel<<<1, 32, 0, stream>>>(p);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  combine_push_kernel<Elem><<<blocks, kSendThreads, 0, stream>>>(p, senders);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (!p.publish) return Status::Ok();  // push mode for certain: the pull-mode kernels would return at once
  combine_reduce_kernel<Elem><<<one_wave(reduce, kCopyThreads, p.copy_blocks), kCopyThreads, 0, stream>>>(p, true);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  combine_wait_kernel<<<1, 32, 0, stream>>>(p);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename Elem>
Status launch_combine_nvshmem(const CombineParams& p, const NormalNvshmemOps* ops, cudaStream_t stream) {
  const void* reduce = reinterpret_cast<const void*>(combine_reduce_kernel<Elem>);
  JAX_EP_RETURN_IF_ERROR(launch_barrier_on(p.g, ops, stream));
  JAX_EP_RETURN_IF_ERROR(from_message(ops->combine_send_and_receive(p, clamp_blocks(p.num_sms), stream)));
  combine_reduce_kernel<Elem><<<one_wave(reduce, kCopyThreads, p.copy_blocks), kCopyThreads, 0, stream>>>(p, false);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

// NVLink kernels: publish + barrier, push combine (push mode), reduce and wait (pull mode): the mode is read on the
// device from the table the first kernel fills, so one launch sequence serves both. NVSHMEM kernels: barrier, their
// send and wait, reduce from staging.
Status launch_combine(const CombineParams& params, cudaStream_t stream) {
  const NormalNvshmemOps* ops = nullptr;
  JAX_EP_RETURN_IF_ERROR(transport_ops(params.g, &ops));
  CombineParams p = params;
  p.pull_table = ops == nullptr;
  const bool bf16 = p.dtype == CombineDtype::kBF16;
  if (ops == nullptr)
    return bf16 ? launch_combine_nvlink<__nv_bfloat16>(p, stream) : launch_combine_nvlink<float>(p, stream);
  return bf16 ? launch_combine_nvshmem<__nv_bfloat16>(p, ops, stream) : launch_combine_nvshmem<float>(p, ops, stream);
}

}  // namespace jax_ep::normal
