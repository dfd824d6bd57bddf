// Normal mode over NVSHMEM (EPConfig.normal_over_nvshmem: one process per GPU, a group wider than one NVLink domain):
// barrier, count exchange, row sending of dispatch / cached dispatch / combine, and the receive wait. Direct ranks
// (this NVLink domain) keep the NVLink kernels' stores and flags; remote ranks (GroupCtx::remote) get the same bytes at
// the same staging positions through NVSHMEM puts, so copy-out and reduce (cuda/kernels/normal_kernels.cu) are shared.
//   barrier  remote pair: signal ADD on kNvshmemBarrier[me] at the peer, waited against this rank's kNvshmemEpoch.
//   counts   remote pair: two put-with-signal, each +1 on kNvshmemCount[me]; the peer waits for 2 and resets.
//   rows     a remote row is staged once in the send area (a put's source must be symmetric) with one meta record per
//            destination, then put; each warp ends with nvshmem_quiet and the last block announces completion (a
//            counted word, counted_signal.cuh). Forwarding groups: normal_forward.cu.
// Reuse: every op begins with a barrier entered after the previous op's wait saw every piece complete, so no put of
// op n is in flight and no counted word is non-zero when op n + 1 writes the send area.
#include <cstdlib>

#include "common/preload.cuh"
#include "device/normal.h"
#include "device/normal_common.cuh"
#include "device/remote_puts.cuh"

namespace jax_ep::nvshmem {
namespace {

// The barrier of transport/peer.cuh (group_barrier_block) with remote pairs signalled through NVSHMEM. Called by
// every thread of one block (any blockDim: thread i takes ranks i, i + blockDim, ...; every arrival is signalled
// before any is waited for). Returns the op's epoch (kBarrierEpoch, shared with the NVLink
// kernels: the direct pairs' data and count flags carry it).
__device__ uint32_t nvshmem_barrier_block(const GroupCtx& g, const char* what) {
  char* self = self_base(g);
  const uint32_t epoch = current_epoch(g) + 1;
  const uint32_t nvshmem_epoch = *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kNvshmemEpoch) + 1;
  const int tid = threadIdx.x;
  if (g.forward_nvl > 0) {
    // Forward record tags to 0 before any source can put this op's records (after this barrier); the fence below
    // orders the clears before this rank's arrivals.
    const BufferLayout& B = g.layout;
    for (int64_t i = tid; i < (B.fwd_nodes - 1) * B.fwd_slots; i += blockDim.x)
      *reinterpret_cast<uint32_t*>(self + B.fwd_meta + i * B.fwd_stride) = 0u;
    __threadfence_system();
  }
  __syncthreads();  // everyone has read the old epochs before thread 0 advances them below
  for (int s = tid; s < g.num_ranks; s += blockDim.x) {
    if (is_remote(g, s))
      nvshmemx_signal_op(nvshmem_word(g, SignalHeader::kNvshmemBarrier, g.rank), 1, NVSHMEM_SIGNAL_ADD, pe_of(g, s));
    else
      red_add_release_sys(header_word(peer_base(g, s), SignalHeader::kBarrierIn + 4 * g.rank), 1u);
  }
  for (int s = tid; s < g.num_ranks; s += blockDim.x) {
    if (is_remote(g, s))
      wait_word_reached(nvshmem_word(g, SignalHeader::kNvshmemBarrier, s), nvshmem_epoch, g, what, s);
    else
      wait_reached(header_word(self, SignalHeader::kBarrierIn + 4 * s), epoch, g.timeout_ns, what, g.rank, s);
  }
  __syncthreads();
  if (tid == 0) {
    *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kBarrierEpoch) = epoch;
    *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kNvshmemEpoch) = nvshmem_epoch;
  }
  return epoch;
}

__global__ void __launch_bounds__(32, 1) nvshmem_barrier_kernel(const __grid_constant__ GroupCtx g) {
  nvshmem_barrier_block(g, "barrier (NVSHMEM)");
}

// Dispatch step 1 (one block): layout, barrier, count exchange (stores to direct ranks, two counted puts to each
// remote rank), handle counts.
__global__ void __launch_bounds__(kLayoutThreads, 1) nvshmem_notify_kernel(const __grid_constant__ DispatchParams p) {
  static_assert(kLayoutThreads >= kMaxGroupRanks, "the count exchange gives rank s to thread s");
  __shared__ layout::BlockSmem sm;
  extern __shared__ int32_t s_expert[];  // [E]
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int tid = threadIdx.x, R = g.num_ranks, me = g.rank, L = p.num_experts / R;
  char* self = self_base(g);
  notify_layout(p, sm, s_expert);  // before the barrier: purely local work overlaps the wait for peers

  const uint32_t epoch = nvshmem_barrier_block(g, "dispatch notify barrier (NVSHMEM)");

  // Direct ranks (this one included, whose row is also the source of the puts) by stores; my per-expert counts
  // into the send area, the source of the remote ranks' slices.
  for (int i = tid; i < R * R; i += blockDim.x) {
    const int d = i / R, c = i % R;
    if (!is_remote(g, d)) reinterpret_cast<int32_t*>(peer_base(g, d) + B.counts)[me * R + c] = sm.rank_base[c];
  }
  for (int i = tid; i < R * L; i += blockDim.x) {
    const int d = i / L, l = i % L;
    if (!is_remote(g, d))
      reinterpret_cast<int32_t*>(peer_base(g, d) + B.expert_counts)[me * L + l] = s_expert[d * L + l];
  }
  for (int e = tid; e < p.num_experts; e += blockDim.x) reinterpret_cast<int32_t*>(self + B.expert_out)[e] = s_expert[e];
  __threadfence();  // the puts below read these from memory
  __syncthreads();
  if (tid < R) {
    if (is_remote(g, tid)) {
      uint64_t* word = nvshmem_word(g, SignalHeader::kNvshmemCount, me);
      char* row = self + B.counts + 4 * static_cast<int64_t>(me) * R;
      // No quiet before the sources (my row, expert_out) are rewritten by the next dispatch: the peer waits for
      // both puts before it arrives at the next barrier, which this rank passes before rewriting them.
      nvshmem_putmem_signal_nbi(row, row, 4 * R, word, 1, NVSHMEM_SIGNAL_ADD, pe_of(g, tid));
      nvshmem_putmem_signal_nbi(self + B.expert_counts + 4 * static_cast<int64_t>(me) * L,
                                self + B.expert_out + 4 * static_cast<int64_t>(tid) * L, 4 * L, word, 1,
                                NVSHMEM_SIGNAL_ADD, pe_of(g, tid));
    } else {
      signal_peer(g, tid, SignalHeader::kCountFlag, epoch);
    }
  }
  if (tid < R) {
    if (is_remote(g, tid)) {
      uint64_t* word = nvshmem_word(g, SignalHeader::kNvshmemCount, tid);
      wait_word_reached(word, 2u, g, "dispatch count exchange (NVSHMEM)", tid);
      nvshmem_signal_wait_until(word, NVSHMEM_CMP_GE, 2);
      *reinterpret_cast<volatile uint64_t*>(word) = 0;  // both puts landed: nothing more comes this op
      __threadfence_system();
    } else {
      wait_peer(g, tid, SignalHeader::kCountFlag, epoch, "dispatch count exchange");
    }
  }
  __syncthreads();
  notify_outputs(p);
}

// Hierarchical dispatch, one warp: token t (its row staged at s_row) to every other node with a destination in it,
// as one row and one forward record (BufferLayout) put into slot [this node][t] of the node's forwarder (the rank
// of this rank's local index). Lane j computes the row of local rank j of the node.
__device__ __forceinline__ void put_forwarded(const SendArgs& a, int t, const char* s_row) {
  const GroupCtx& g = a.g;
  const BufferLayout& B = g.layout;
  const int nvl = g.forward_nvl, nodes = g.num_ranks / nvl, my_node = g.rank / nvl, lane = lane_id();
  const int K = a.num_weights;
  const int64_t Km = B.meta_k;
  char* self = self_base(g);
  const int rec_bytes = static_cast<int>(forward_record_bytes(Km, a.scale_cols));
  for (int n = 0; n < nodes; ++n) {
    if (n == my_node) continue;
    const int32_t row = lane < nvl ? token_row(a, t, n * nvl + lane) : -1;
    if (__ballot_sync(0xffffffffu, row >= 0) == 0u) continue;  // no destination in node n
    char* rec = self + B.send_fwd_meta + (static_cast<int64_t>(t) * (nodes - 1) + n - (n > my_node ? 1 : 0)) *
                                             B.fwd_stride;
    if (lane == 0) *reinterpret_cast<uint32_t*>(rec) = 1u;
    if (lane < kMaxNvlPeers) reinterpret_cast<int32_t*>(rec + 4)[lane] = row;
    if (lane < K) {
      const int64_t at = static_cast<int64_t>(t) * K + lane;
      reinterpret_cast<int32_t*>(rec + 4 * (1 + kMaxNvlPeers))[lane] = a.topk_idx != nullptr ? __ldg(a.topk_idx + at) : -1;
      reinterpret_cast<float*>(rec + 4 * (1 + kMaxNvlPeers + Km))[lane] = __ldg(a.weights + at);
    }
    float* scales = reinterpret_cast<float*>(rec + 4 * (1 + kMaxNvlPeers + 2 * Km));
    for (int j = lane; j < a.scale_cols; j += 32)
      scales[j] = __ldg(a.scales + static_cast<int64_t>(t) * a.scale_cols + j);
    __threadfence();  // the record is in memory before the put reads it
    __syncwarp();
    const int pe = pe_of(g, n * nvl + g.rank % nvl);
    const int64_t slot = forward_slot(B, my_node, n, t);  // at the forwarder, of node n
    put_plain(self + B.fwd_rows + slot * a.row_bytes, s_row, a.row_bytes, pe);
    put_plain(self + B.fwd_meta + slot * B.fwd_stride, rec, rec_bytes, pe);
  }
}

// Dispatch / cached dispatch rows: one warp per token. Direct destinations get the NVLink stores; for remote ones
// the token's row is staged once in the send area with one meta record per remote destination, then put as two
// pieces: the row into the staging row the stores would fill, the record into the same row of remote_meta.
// kSlots: ranks per pass over the destinations (register arrays): kMaxNvlPeers for R <= 8 (one pass), kWideSlots
// above (one pass per chunk of 32 ranks; chunks without a destination of the token are skipped).
template <int kSlots>
__global__ void __launch_bounds__(kSendThreads) nvshmem_send_rows_kernel(const __grid_constant__ SendArgs a) {
  const GroupCtx& g = a.g;
  const BufferLayout& B = g.layout;
  const int R = g.num_ranks, lane = lane_id(), K = a.num_weights;
  const uint32_t epoch = current_epoch(g);
  char* self = self_base(g);
  bool put_any = false;
  // One meta record per remote destination (its local ids and weights differ): weights, ids, source index,
  // scales (staging_layout.h); cached dispatch only has weights.
  const int64_t Km = B.meta_k;
  const bool full_record = a.topk_idx != nullptr || a.write_src_idx || a.scale_cols > 0;
  const int meta_bytes = full_record ? static_cast<int>(4 * (2 * Km + 1) + 4 * a.scale_cols) : 4 * K;

  for (int t = global_warp(); t < a.num_tokens; t += num_global_warps()) {
    char* s_row = self + B.send_rows + static_cast<int64_t>(t) * a.row_bytes;
    bool staged = false;  // warp-uniform: rows[] are the same in every lane
    // kMaxNvlPeers: R <= 8, one pass (the bound lets the compiler drop the loop)
    for (int first = 0; first < (kSlots >= kWideSlots ? R : 1); first += kSlots) {
      int32_t rows[kSlots], direct[kSlots];
      token_rows<kSlots>(a, t, first, rows);
      bool any_dest = false, any_remote = false;
#pragma unroll
      for (int d = 0; d < kSlots; ++d) {
        const bool remote = rows[d] >= 0 && is_remote(g, first + d);
        direct[d] = remote ? -1 : rows[d];
        any_dest |= rows[d] >= 0;
        any_remote |= remote;
      }
      if (!any_dest) continue;
      store_token<kSlots>(a, t, first, direct);
      if (!any_remote) continue;
      if (!staged) {
        warp_copy_row(reinterpret_cast<int4*>(s_row),
                      reinterpret_cast<const int4*>(a.rows + static_cast<int64_t>(t) * a.row_bytes), a.row_bytes);
        staged = put_any = true;
      }
      if (g.forward_nvl > 0) continue;  // every other node once, after the last chunk (put_forwarded)
#pragma unroll 1
      for (int d = 0; d < kSlots; ++d) {
        if (direct[d] >= 0 || rows[d] < 0) continue;
        char* rec = self + B.send_meta + (static_cast<int64_t>(t) * R + first + d) * B.meta_stride;
        if (lane < K) {
          int32_t id;
          float w;
          local_entry(a, t, lane, first + d, &id, &w);
          reinterpret_cast<float*>(rec)[lane] = w;
          if (full_record) reinterpret_cast<int32_t*>(rec + 4 * Km)[lane] = id;
        }
        if (full_record && lane == 0) *reinterpret_cast<int32_t*>(rec + 8 * Km) = t;
        float* scales = reinterpret_cast<float*>(rec + 4 * (2 * Km + 1));
        for (int j = lane; j < a.scale_cols; j += 32)
          scales[j] = __ldg(a.scales + static_cast<int64_t>(t) * a.scale_cols + j);
      }
      __threadfence();  // the staged bytes are in memory before a put reads them
      __syncwarp();
#pragma unroll 1
      for (int d = 0; d < kSlots; ++d) {
        if (direct[d] >= 0 || rows[d] < 0) continue;
        const int pe = pe_of(g, first + d);
        const int64_t row = rows[d];
        put_plain(self + B.payload + row * a.row_bytes, s_row, a.row_bytes, pe);
        if (meta_bytes > 0)
          put_plain(self + B.remote_meta + row * B.meta_stride,
                    self + B.send_meta + (static_cast<int64_t>(t) * R + first + d) * B.meta_stride, meta_bytes, pe);
      }
    }
    if (staged && g.forward_nvl > 0) {
      __threadfence();  // the staged row is in memory before a put reads it
      put_forwarded(a, t, s_row);
    }
  }
  if (put_any) nvshmem_quiet();  // this warp's puts (every lane issued part of them) are delivered
  finish_and_announce(g, epoch, g.forward_nvl > 0 ? kAnnounceForwarders : kAnnounceAll);
}

// Combine rows: the NVLink kernel's interleaved walk over the received rows. A row of a direct source is stored into
// its combine_slot; a row of a remote source is staged in the send area (indexed by the received row), then put with
// its weights into the source's combine_slot (flat), or, in a forwarding group, left there for the node's forwarder
// of that source, which reads it (normal_forward.cu): this rank's row index goes into the forwarder's combine record
// of (source node, token) with this rank's bit of its contributor mask.
__global__ void __launch_bounds__(kSendThreads) nvshmem_combine_send_kernel(const __grid_constant__ CombineParams p) {
  __shared__ int32_t s_begin[kMaxGroupRanks], s_end[kMaxGroupRanks], s_span;
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int R = g.num_ranks, me = g.rank, lane = lane_id(), Kw = p.num_weights;
  const uint32_t epoch = current_epoch(g);
  combine_source_spans(p, s_begin, s_end, &s_span);
  char* self = self_base(g);
  bool put_any = false;
  const int num_src = R - 1;
  const int64_t total = static_cast<int64_t>(num_src) * s_span;

  for (int64_t j = global_warp(); j < total; j += num_global_warps()) {
    const int from = (me + 1 + static_cast<int>(j % num_src)) % R;
    const int32_t row = s_begin[from] + static_cast<int32_t>(j / num_src);
    if (row >= s_end[from]) continue;
    const int32_t t = combine_row_token(p, row, from);
    if (t < 0) continue;
    const int64_t slot = combine_slot(g, me, t, p.max_tokens_per_rank);
    if (!is_remote(g, from)) {
      store_combine_row(p, peer_base(g, from), slot, row);
      continue;
    }
    char* s_row = self + B.send_rows + static_cast<int64_t>(row) * p.row_bytes;
    warp_copy_row(reinterpret_cast<int4*>(s_row),
                  reinterpret_cast<const int4*>(static_cast<const char*>(p.values) + static_cast<int64_t>(row) *
                                                p.row_bytes),
                  p.row_bytes);
    float* s_w = reinterpret_cast<float*>(self + B.send_weights) + static_cast<int64_t>(row) * Kw;
    if (lane < Kw) s_w[lane] = __ldg(p.weights + static_cast<int64_t>(row) * Kw + lane);
    if (g.forward_nvl > 0) {
      // Node-first: the forwarder of `from` (this node's rank with from's local index) reads the staged row after
      // this rank's announcement (kAnnounceNode, whose release covers the stores above); its combine record of
      // (from's node, t) gets this rank's row index and contributor bit.
      const int nvl = g.forward_nvl, node = from / nvl, f = (me / nvl) * nvl + from % nvl;
      char* rec = peer_base(g, f) + B.fwd_meta + forward_slot(B, node, me / nvl, t) * B.fwd_stride;
      if (lane == 0) {
        reinterpret_cast<int32_t*>(rec + combine_record_rows_offset(B.meta_k))[me % nvl] = row;
        atomicOr_system(reinterpret_cast<unsigned int*>(rec), 1u << (me % nvl));
      }
      continue;
    }
    __threadfence();
    __syncwarp();
    const int pe = pe_of(g, from);
    put_plain(self + B.payload + slot * p.row_bytes, s_row, p.row_bytes, pe);
    if (Kw > 0) put_plain(self + B.topk_weights + slot * 4 * Kw, reinterpret_cast<const char*>(s_w), 4 * Kw, pe);
    put_any = true;
  }
  if (put_any) nvshmem_quiet();
  finish_and_announce(g, epoch, g.forward_nvl > 0 ? kAnnounceNode : kAnnounceAll);
}

// Which announcements a wait kernel waits for.
enum WaitFor : int {
  kWaitAll = 0,         // flat kernels: every remote rank's completion word, every direct rank's data flag
  kWaitForwarders = 1,  // forwarding groups: the remote ranks of this rank's local index (dispatch: before forwarding;
                        // combine: their node partials, last)
  kWaitNode = 2,        // forwarding groups: the data flags of this node's ranks (dispatch: last; combine: before
                        // the forwarder's sums)
};

// Waits (one warp, as the NVLink kernels' wait: only this kernel spins) until the rows of the ranks `which` names
// are in this rank's staging (kWaitForwarders: in its forwarding area).
__global__ void __launch_bounds__(32, 1) nvshmem_wait_data_kernel(const __grid_constant__ GroupCtx g, int which) {
  const uint32_t epoch = current_epoch(g);
  for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x) {
    if (is_remote(g, s)) {
      if (which == kWaitNode || (which == kWaitForwarders && s % g.forward_nvl != g.rank % g.forward_nvl)) continue;
      wait_complete_and_reset(nvshmem_word(g, SignalHeader::kNvshmemData, s), g, "receive (NVSHMEM, data from peers)",
                              s);
    } else if (which != kWaitForwarders) {
      wait_peer(g, s, SignalHeader::kDataFlag, epoch, "receive (data from peers)");
    }
  }
}


// ---- launchers (the NormalNvshmemOps entries) ------------------------------------------------------------------------
const char* barrier(const GroupCtx& g, cudaStream_t stream) {
  nvshmem_barrier_kernel<<<1, 32, 0, stream>>>(g);
  return launch_error("normal-mode barrier (NVSHMEM)");
}

const char* dispatch_notify(const DispatchParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(p.num_experts);
  nvshmem_notify_kernel<<<1, kLayoutThreads, smem, stream>>>(p);
  return launch_error("dispatch notify (NVSHMEM)");
}

// Dispatch / cached dispatch: send, and (hierarchical) forward, until every row of the op is in this rank's staging.
const char* send_and_receive_rows(const SendArgs& a, int blocks, cudaStream_t stream) {
  // Test hook JAX_EP_TEST_WIDE_SEND=1: the chunked instance for any R, so that the sanitizer runs cover it on 2 GPUs.
  static const bool wide = [] {
    const char* v = std::getenv("JAX_EP_TEST_WIDE_SEND");
    return v != nullptr && v[0] == '1';
  }();
  if (a.g.num_ranks <= kMaxNvlPeers && !wide)
    nvshmem_send_rows_kernel<kMaxNvlPeers><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(a);
  else
    nvshmem_send_rows_kernel<kWideSlots><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(a);
  if (const char* err = launch_error("dispatch send (NVSHMEM)")) return err;
  if (a.g.forward_nvl > 0) {
    nvshmem_wait_data_kernel<<<1, 32, 0, stream>>>(a.g, kWaitForwarders);
    if (const char* err = launch_error("dispatch forward wait (NVSHMEM)")) return err;
    if (const char* err = launch_dispatch_forward(a, blocks, stream)) return err;
  }
  nvshmem_wait_data_kernel<<<1, 32, 0, stream>>>(a.g, a.g.forward_nvl > 0 ? kWaitNode : kWaitAll);
  return launch_error("normal-mode receive wait (NVSHMEM)");
}

// Combine: send (node-first: inside the node, then the forwarders' partial sums across nodes) until every row or
// partial of this rank's tokens is in its staging; the reduction follows in stream order.
const char* combine_send_and_receive(const CombineParams& p, int blocks, cudaStream_t stream) {
  nvshmem_combine_send_kernel<<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(p);
  if (const char* err = launch_error("combine send (NVSHMEM)")) return err;
  if (p.g.forward_nvl > 0) {
    nvshmem_wait_data_kernel<<<1, 32, 0, stream>>>(p.g, kWaitNode);
    if (const char* err = launch_error("combine node wait")) return err;
    if (const char* err = launch_combine_forward(p, blocks, stream)) return err;
  }
  nvshmem_wait_data_kernel<<<1, 32, 0, stream>>>(p.g, p.g.forward_nvl > 0 ? kWaitForwarders : kWaitAll);
  return launch_error("normal-mode receive wait (NVSHMEM)");
}

const NormalNvshmemOps kOps = {kNormalNvshmemAbi, &barrier, &dispatch_notify, &send_and_receive_rows,
                            &combine_send_and_receive};

}  // namespace

const NormalNvshmemOps* normal_ops() { return &kOps; }

Status preload_normal_kernels() {
  const Status st = preload({reinterpret_cast<const void*>(nvshmem_barrier_kernel),
                             reinterpret_cast<const void*>(nvshmem_notify_kernel),
                             reinterpret_cast<const void*>(nvshmem_send_rows_kernel<kMaxNvlPeers>),
                             reinterpret_cast<const void*>(nvshmem_send_rows_kernel<kWideSlots>),
                             reinterpret_cast<const void*>(nvshmem_combine_send_kernel),
                             reinterpret_cast<const void*>(nvshmem_wait_data_kernel)});
  return st.ok() ? preload_forward_kernels() : st;
}

}  // namespace jax_ep::nvshmem
