// Normal mode over NVSHMEM (EPConfig.normal_over_nvshmem: a group wider than one NVLink domain, one process per
// GPU): the barrier, the count exchange, the row sending of dispatch / cached dispatch / combine and the receive
// wait, for a group where some ranks are *remote* (GroupCtx::remote: another NVLink domain of num_max_nvl_peers
// ranks, or no load/store mapping). Ranks of this rank's domain keep the NVLink kernels' stores and flags
// (normal_device.cuh, transport/peer.cuh); remote ranks get the same bytes at the same staging positions through
// NVSHMEM puts, so the copy-out and the combine reduction (cuda/kernels/normal_kernels.cu) are unchanged.
//   barrier     remote pair: an NVSHMEM signal ADD of 1 to kRdmaBarrier[me] at the peer per op, waited for against
//               this rank's own count of such barriers (kRdmaEpoch); direct pair: the NVLink barrier's words.
//   counts      remote pair: two put-with-signal (my row of the count matrix, my per-expert counts of the peer's
//               experts), each +1 on kRdmaCount[me] at the peer; the peer waits for 2 and resets the word.
//   rows        remote pair: the token's row staged once in this rank's send area (symmetric memory: a put's source
//               must be) and one meta record per destination (weights, local ids, source index, fp8 scales), then
//               two non-blocking puts: the row into the peer's payload row, the record into its remote_meta row
//               (the copy-out reads a remote source's metadata from there; staging_layout.h); every warp ends its puts with nvshmem_quiet (delivered, on any transport), and the
//               last block to finish announces completion to each remote peer (one signal ADD of a counted word
//               with zero counted messages, counted_signal.cuh) and flags the direct peers as before.
//               NOTE (why not a put-with-signal per piece, as the LL kernels): 2x H200, EP2, T=4096, H=7168: a
//               counted signal per piece (5 per token and peer: each a system fence) cost 589 us for bf16 dispatch,
//               against 331 us for the NVLink kernels; the LL kernels need per-message signals (no grid-wide end
//               before the receiver reads), normal mode has one.
//   wait        remote source: its word announced, NVSHMEM's wait once (the transport's consistency step),
//               reset to 0; direct source: the NVLink data flag.
// One mechanism per word: the kRdma* words of a pair are only touched by NVSHMEM signal ops of the remote peer and
// by this rank's own loads / resets; the NVLink words only by GPU stores and atomics of direct peers.
//   forwarded   hierarchical dispatch (GroupCtx::forward_nvl = num_max_nvl_peers > 1: nodes of 2-8 ranks): a token
//               crosses to each destination node once, as one row and one forward record (its destination rows in
//               that node, global ids, weights, scales) put into the forwarding area of the node's rank with this
//               rank's local index (the forwarder), slot [source node][token]. The forwarder waits for the sources
//               of its local index (their completion words), then stores each forwarded row and its meta record over
//               NVLink into the staging rows of its node's destinations (the rows the flat kernels would have put),
//               and flags its node's ranks: a rank's receive waits for its node's ranks only.
//               Record tags are cleared at every barrier, before this rank arrives: a non-zero tag was put this op.
//   node-first  combine of a forwarding group: a row for a source on another node goes by NVLink stores into the
//               node's forwarder of the source's local index (payload slot [source node * P + my local][t]) with my
//               bit OR-ed into its contributor mask (the tag word of record [source node][t]); the forwarder sums
//               the contributed rows in f32 and puts one partial row in the values' dtype (and f32 weights at
//               record offset 4) per (token, node) into the source's forwarding area [its node][t]; the source adds
//               each node's partial once.
// Traffic: with forwarding, one copy per (token, destination node) each way (combine: a partial row); otherwise
// one copy per (token, destination rank) (docs/INTERNODE.md).
// NOTE (reuse of the send area and the counted words): every op begins with a barrier that a rank enters only after
// its previous op's wait kernel, which saw every peer's pieces complete (forwarded dispatch: its forwarders' waits
// saw the remote pieces, and its final wait their flags, raised after); so no put of op n is in flight, and no
// counted word is non-zero, when op n + 1 writes the send area or sends.
// NOTE (cost): the tag clearing runs in every barrier of a forwarding group (nodes x T_max scattered stores before
// the rank arrives; in the one-warp barrier kernel of cached dispatch and combine too): to trim once the path can
// be timed.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdio>
#include <cstdlib>

#include "common/preload.cuh"
#include "device/counted_signal.cuh"
#include "device/normal_rdma.h"
#include "device/remote_puts.cuh"
#include "kernels/normal_device.cuh"

namespace jax_ep::rdma {
namespace {

using namespace jax_ep::normal;  // NOLINT

__device__ __forceinline__ bool is_remote(const GroupCtx& g, int d) { return (g.remote >> d) & 1u; }

// NVSHMEM PE of rank d (a dynamic index into the __grid_constant__ parameter: transport/peer.cuh, peer_base).
__device__ __forceinline__ int pe_of(const GroupCtx& g, int d) { return g.pe[d]; }

__device__ __forceinline__ uint64_t* rdma_word(const GroupCtx& g, int64_t offset, int index) {
  return reinterpret_cast<uint64_t*>(self_base(g) + offset) + index;
}

// Bounded wait until the low 32 bits of a monotonic u64 signal word reach `target` (wrap-safe); traps after
// g.timeout_ns naming the peer.
__device__ __forceinline__ void wait_word_reached(uint64_t* word, uint32_t target, const GroupCtx& g,
                                                  const char* what, int peer) {
  if (reached(static_cast<uint32_t>(nvshmem_signal_fetch(word)), target)) return;
  const uint64_t start = global_timer_ns();
  while (!reached(static_cast<uint32_t>(nvshmem_signal_fetch(word)), target)) {
    if (global_timer_ns() - start > g.timeout_ns) {
      printf("jax_ep: timeout after %llu ns in %s on rank %d: remote rank %d has not arrived (count %u, want %u); "
             "a peer is missing or runs another program. Trapping.\n",
             static_cast<unsigned long long>(g.timeout_ns), what, g.rank, peer,
             static_cast<uint32_t>(nvshmem_signal_fetch(word)), target);
      __trap();
    }
  }
}

// Bounded wait for a complete counted word (counted_signal.cuh), then NVSHMEM's wait once (returns at once; on
// proxy transports it makes the NIC's data writes visible), a reset for the next op and a system fence: the rows
// the word vouches for are read after it.
__device__ __forceinline__ void wait_complete_and_reset(uint64_t* word, const GroupCtx& g, const char* what,
                                                        int peer) {
  uint64_t seen = 0;
  if (!wait_complete(word, g.timeout_ns, &seen)) {
    printf("jax_ep: timeout after %llu ns in %s on rank %d: remote rank %d word %u, announced %d; a peer is "
           "missing or runs another program. Trapping.\n",
           static_cast<unsigned long long>(g.timeout_ns), what, g.rank, peer, static_cast<uint32_t>(seen),
           static_cast<int>(seen >> kAnnounceShift) - 1);
    __trap();
  }
  nvshmem_signal_wait_until(word, NVSHMEM_CMP_GE, seen);
  *reinterpret_cast<volatile uint64_t*>(word) = 0;
  __threadfence_system();
}

// The barrier of transport/peer.cuh (group_barrier_block) with remote pairs signalled through NVSHMEM. Called by
// every thread of one block (blockDim >= R). Returns the op's epoch (kBarrierEpoch, shared with the NVLink
// kernels: the direct pairs' data and count flags carry it).
__device__ uint32_t rdma_barrier_block(const GroupCtx& g, const char* what) {
  char* self = self_base(g);
  const uint32_t epoch = current_epoch(g) + 1;
  const uint32_t rdma_epoch = *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kRdmaEpoch) + 1;
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
  if (tid < g.num_ranks) {
    if (is_remote(g, tid)) {
      nvshmemx_signal_op(rdma_word(g, SignalHeader::kRdmaBarrier, g.rank), 1, NVSHMEM_SIGNAL_ADD, pe_of(g, tid));
      wait_word_reached(rdma_word(g, SignalHeader::kRdmaBarrier, tid), rdma_epoch, g, what, tid);
    } else {
      red_add_release_sys(header_word(peer_base(g, tid), SignalHeader::kBarrierIn + 4 * g.rank), 1u);
      wait_reached(header_word(self, SignalHeader::kBarrierIn + 4 * tid), epoch, g.timeout_ns, what, g.rank, tid);
    }
  }
  __syncthreads();
  if (tid == 0) {
    *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kBarrierEpoch) = epoch;
    *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kRdmaEpoch) = rdma_epoch;
  }
  return epoch;
}

__global__ void __launch_bounds__(32, 1) rdma_barrier_kernel(const __grid_constant__ GroupCtx g) {
  rdma_barrier_block(g, "barrier (NVSHMEM)");
}

// Dispatch step 1 (one block): layout, barrier, count exchange (stores to direct ranks, two counted puts to each
// remote rank), handle counts.
__global__ void __launch_bounds__(kLayoutThreads, 1) rdma_notify_kernel(const __grid_constant__ DispatchParams p) {
  __shared__ routing::BlockSmem sm;
  __shared__ int32_t s_counts[kMaxGroupRanks][kMaxGroupRanks];
  extern __shared__ int32_t s_expert[];  // [E]
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int tid = threadIdx.x, R = g.num_ranks, me = g.rank, L = p.num_experts / R;
  char* self = self_base(g);
  notify_layout(p, sm, s_expert);  // before the barrier: purely local work overlaps the wait for peers

  const uint32_t epoch = rdma_barrier_block(g, "dispatch notify barrier (NVSHMEM)");

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
      uint64_t* word = rdma_word(g, SignalHeader::kRdmaCount, me);
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
      uint64_t* word = rdma_word(g, SignalHeader::kRdmaCount, tid);
      wait_word_reached(word, 2u, g, "dispatch count exchange (NVSHMEM)", tid);
      nvshmem_signal_wait_until(word, NVSHMEM_CMP_GE, 2);
      *reinterpret_cast<volatile uint64_t*>(word) = 0;  // both puts landed: nothing more comes this op
      __threadfence_system();
    } else {
      wait_peer(g, tid, SignalHeader::kCountFlag, epoch, "dispatch count exchange");
    }
  }
  __syncthreads();
  notify_outputs(p, s_counts);
}

// The last block of a grid to get here (every thread of every block calls it; a block's stores and each warp's
// nvshmem_quiet come before) returns true in thread 0 of that block, with every block's work visible at system
// scope; the counter is reset for the next sending kernel.
__device__ __forceinline__ bool last_block_done(const GroupCtx& g) {
  __syncthreads();
  if (threadIdx.x != 0) return false;
  __threadfence_system();  // this block's stores to direct peers happen before it is counted
  uint32_t* done = header_word(self_base(g), SignalHeader::kBlockDone);
  if (atomicAdd(done, 1u) != gridDim.x - 1) return false;
  atomicExch(done, 0u);  // every block has counted itself: reset for the next kernel
  __threadfence_system();  // every block's quiet (its puts delivered) happens before the caller's announcements
  return true;
}

// Who the last block of a sending kernel tells that this rank's rows of the op are complete.
enum Announce : int {
  kAnnounceAll = 0,         // flat kernels: every remote rank (completion word) and every direct rank (data flag)
  kAnnounceForwarders = 1,  // the remote ranks of this rank's local index only (hierarchical: the RDMA leg)
  kAnnounceNode = 2,        // the direct ranks (this node) only (hierarchical: the NVLink leg)
};

// End of a sending kernel (every thread of every block): the last block announces completion, to remote ranks with
// a counted word of zero counted messages (complete at once), to direct ranks with the NVLink data flag
// (finish_and_signal_data of the NVLink kernels).
__device__ __forceinline__ void finish_and_announce(const GroupCtx& g, uint32_t epoch, Announce to = kAnnounceAll) {
  if (!last_block_done(g)) return;
  for (int d = 0; d < g.num_ranks; ++d) {
    if (is_remote(g, d)) {
      if (to == kAnnounceAll || (to == kAnnounceForwarders && d % g.forward_nvl == g.rank % g.forward_nvl))
        nvshmemx_signal_op(rdma_word(g, SignalHeader::kRdmaData, g.rank), announce_value(0), NVSHMEM_SIGNAL_ADD,
                           pe_of(g, d));
    } else if (to != kAnnounceForwarders) {
      signal_peer(g, d, SignalHeader::kDataFlag, epoch);
    }
  }
}

// Work item `item` of a forwarder's grid-stride loop over (other node, token) pairs: node n != my_node, token t.
// The items enumerate only the other nodes. (A loop over every node that skipped this node's items left idle every
// warp whose index drew only this node: with a warp count divisible by the node count, warp w only ever drew node
// w % nodes, so half the warps at 2 nodes, a third at 3. Measured 2026-11-26: the node-first combine's forwarder
// took 791 of 1241 us per call at EP4 as 2 nodes of 2.)
__device__ __forceinline__ void other_node_item(int64_t item, int nodes, int my_node, int* n, int* t) {
  const int k = static_cast<int>(item % (nodes - 1));
  *n = k + (k >= my_node ? 1 : 0);
  *t = static_cast<int>(item / (nodes - 1));
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
// kSlots >= R: the per-token destination arrays (kMaxNvlPeers for R <= 8, kMaxGroupRanks above).
template <int kSlots>
__global__ void __launch_bounds__(kSendThreads) rdma_send_rows_kernel(const __grid_constant__ SendArgs a) {
  const GroupCtx& g = a.g;
  const BufferLayout& B = g.layout;
  const int R = g.num_ranks, lane = lane_id(), K = a.num_weights;
  const uint32_t epoch = current_epoch(g);
  char* self = self_base(g);
  bool put_any = false;

  for (int t = global_warp(); t < a.num_tokens; t += num_global_warps()) {
    int32_t rows[kSlots], direct[kSlots];
    token_rows<kSlots>(a, t, rows);
    bool any_remote = false;
#pragma unroll
    for (int d = 0; d < kSlots; ++d) {
      const bool remote = rows[d] >= 0 && is_remote(g, d);
      direct[d] = remote ? -1 : rows[d];
      any_remote |= remote;
    }
    store_token<kSlots>(a, t, direct);
    if (!any_remote) continue;
    put_any = true;

    char* s_row = self + B.send_rows + static_cast<int64_t>(t) * a.row_bytes;
    warp_copy_row(reinterpret_cast<int4*>(s_row), reinterpret_cast<const int4*>(a.rows + static_cast<int64_t>(t) *
                                                                                      a.row_bytes),
                  a.row_bytes);
    if (g.forward_nvl > 0) {
      __threadfence();  // the staged row is in memory before a put reads it
      put_forwarded(a, t, s_row);
      continue;
    }
    // One meta record per remote destination (its local ids and weights differ): weights, ids, source index,
    // scales (staging_layout.h); cached dispatch only has weights.
    const int64_t Km = B.meta_k;
    const bool full_record = a.topk_idx != nullptr || a.write_src_idx || a.scale_cols > 0;
    const int meta_bytes = full_record ? static_cast<int>(4 * (2 * Km + 1) + 4 * a.scale_cols) : 4 * K;
    for (int d = 0; d < R; ++d) {
      if (direct[d] >= 0 || rows[d] < 0) continue;
      char* rec = self + B.send_meta + (static_cast<int64_t>(t) * R + d) * B.meta_stride;
      if (lane < K) {
        int32_t id;
        float w;
        local_entry(a, t, lane, d, &id, &w);
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

    for (int d = 0; d < R; ++d) {
      if (direct[d] >= 0 || rows[d] < 0) continue;
      const int pe = pe_of(g, d);
      const int64_t row = rows[d];
      put_plain(self + B.payload + row * a.row_bytes, s_row, a.row_bytes, pe);
      if (meta_bytes > 0)
        put_plain(self + B.remote_meta + row * B.meta_stride,
                  self + B.send_meta + (static_cast<int64_t>(t) * R + d) * B.meta_stride, meta_bytes, pe);
    }
  }
  if (put_any) nvshmem_quiet();  // this warp's puts (every lane issued part of them) are delivered
  finish_and_announce(g, epoch, g.forward_nvl > 0 ? kAnnounceForwarders : kAnnounceAll);
}

// Hierarchical dispatch, after the sources of this rank's local index have announced (wait kernel, kWaitForwarders):
// every forwarded token of slot [node][t] (tag set) goes to the destination rows of this node its record names,
// over NVLink: the row into payload, the destination's meta record (its local ids and weights, source index,
// scales) into remote_meta, as the flat kernels' puts would have. The last block then flags this node's ranks.
// One warp per (source node, token); the direct rows of this rank's own send kernel are in place (stream order).
// NOTE: the slots walked are [0, a.num_tokens) of each source node: every shard of a shard_map call has the same T
// (static shapes), so a source's tokens are this rank's count. The forwarding area is read through the
// non-coherent path (fan_out_row's ld_nc_v4): valid because every put of the op has landed before this kernel
// starts (the kWaitForwarders kernel before it); forwarding while the RDMA leg is in flight would need ld_cg.
__global__ void __launch_bounds__(kSendThreads) rdma_forward_kernel(const __grid_constant__ SendArgs a) {
  const GroupCtx& g = a.g;
  const BufferLayout& B = g.layout;
  const int nvl = g.forward_nvl, R = g.num_ranks, nodes = R / nvl, my_node = g.rank / nvl, lane = lane_id();
  const int K = a.num_weights;
  const int64_t Km = B.meta_k;
  const bool has_ids = a.topk_idx != nullptr;
  const bool full_record = has_ids || a.write_src_idx || a.scale_cols > 0;
  const uint32_t epoch = current_epoch(g);
  const char* self = self_base(g);
  const int64_t total = static_cast<int64_t>(nodes - 1) * a.num_tokens;  // nodes >= 2 in a forwarding group
  for (int64_t item = global_warp(); item < total; item += num_global_warps()) {
    int n, t;
    other_node_item(item, nodes, my_node, &n, &t);
    const int64_t slot = forward_slot(B, n, my_node, t);
    const char* rec = self + B.fwd_meta + slot * B.fwd_stride;
    if (__ldcg(reinterpret_cast<const uint32_t*>(rec)) == 0u) continue;  // no destination in this node
    int32_t rows[kMaxNvlPeers];
    const int32_t my_row = lane < nvl ? __ldcg(reinterpret_cast<const int32_t*>(rec + 4) + lane) : -1;
#pragma unroll
    for (int j = 0; j < kMaxNvlPeers; ++j) rows[j] = __shfl_sync(0xffffffffu, my_row, j);
    fan_out_row<kMaxNvlPeers>(reinterpret_cast<const int4*>(self + B.fwd_rows + slot * a.row_bytes), a.row_bytes / 16,
                              rows, [&](int j) {
                                return reinterpret_cast<int4*>(peer_base(g, my_node * nvl + j) + B.payload +
                                                               static_cast<int64_t>(rows[j]) * a.row_bytes);
                              });
    const int32_t* ids = reinterpret_cast<const int32_t*>(rec + 4 * (1 + kMaxNvlPeers));
    const float* ws = reinterpret_cast<const float*>(rec + 4 * (1 + kMaxNvlPeers + Km));
    const float* scales = reinterpret_cast<const float*>(rec + 4 * (1 + kMaxNvlPeers + 2 * Km));
#pragma unroll
    for (int j = 0; j < kMaxNvlPeers; ++j) {
      if (rows[j] < 0) continue;
      const int d = my_node * nvl + j;
      char* out = peer_base(g, d) + B.remote_meta + static_cast<int64_t>(rows[j]) * B.meta_stride;
      if (lane < K) {
        int32_t id;
        float w;
        local_entry_of(has_ids ? __ldcg(ids + lane) : -1, __ldcg(ws + lane), has_ids, d, a.experts_per_rank, R, &id,
                       &w);
        reinterpret_cast<float*>(out)[lane] = w;
        if (full_record) reinterpret_cast<int32_t*>(out + 4 * Km)[lane] = id;
      }
      if (full_record && lane == 0) *reinterpret_cast<int32_t*>(out + 8 * Km) = t;
      float* out_scales = reinterpret_cast<float*>(out + 4 * (2 * Km + 1));
      for (int c = lane; c < a.scale_cols; c += 32) out_scales[c] = __ldcg(scales + c);
    }
  }
  finish_and_announce(g, epoch, kAnnounceNode);
}

// Combine rows: the NVLink kernel's interleaved walk over the received rows; a row of a remote source is staged in
// the send area (indexed by the received row) and put with its weights into the source's slot [me][token], or, in
// a forwarding group, stored into the node's forwarder for that source (node-first, above).
__global__ void __launch_bounds__(kSendThreads) rdma_combine_send_kernel(const __grid_constant__ CombineParams p) {
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
    const int64_t slot = static_cast<int64_t>(me) * p.max_tokens_per_rank + t;
    if (!is_remote(g, from)) {
      store_combine_row(p, peer_base(g, from), slot, row);
      continue;
    }
    if (g.forward_nvl > 0) {
      // Node-first: into the forwarder of `from` (this node's rank with from's local index), slot
      // [from's node * P + my local index][t], and my bit of its contributor mask for (from's node, t).
      const int nvl = g.forward_nvl, node = from / nvl, f = (me / nvl) * nvl + from % nvl;
      store_combine_row(p, peer_base(g, f), static_cast<int64_t>(node * nvl + me % nvl) * p.max_tokens_per_rank + t,
                        row);
      if (lane == 0)
        atomicOr_system(reinterpret_cast<unsigned int*>(peer_base(g, f) + B.fwd_meta +
                                                        forward_slot(B, node, me / nvl, t) * B.fwd_stride),
                        1u << (me % nvl));
      continue;
    }
    char* s_row = self + B.send_rows + static_cast<int64_t>(row) * p.row_bytes;
    warp_copy_row(reinterpret_cast<int4*>(s_row),
                  reinterpret_cast<const int4*>(static_cast<const char*>(p.values) + static_cast<int64_t>(row) *
                                                p.row_bytes),
                  p.row_bytes);
    float* s_w = reinterpret_cast<float*>(self + B.send_weights) + static_cast<int64_t>(row) * Kw;
    if (lane < Kw) s_w[lane] = __ldg(p.weights + static_cast<int64_t>(row) * Kw + lane);
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

// Node-first combine, on the forwarder, after its node's ranks have flagged their rows (kWaitNode): for every
// (source node n, token t) with a contributor mask (the record tag word of slot [n][t], OR-ed in by the node's ranks;
// cleared at the barrier), the f32 sum of the contributed rows in local-index order cast to the values' dtype, and the
// f32 sum of their weights, staged in the send area and put into the fwd_rows / fwd_meta slot [this node][t] of the source (n, this local index). One
// warp per (n, t); the last block announces to the sources of this local index.
constexpr int kForwardUnroll = 4;  // 16-byte vectors per lane in flight in the forwarder's sums
template <typename Elem>
__global__ void __launch_bounds__(kSendThreads) rdma_combine_forward_kernel(const __grid_constant__ CombineParams p) {
  using Pk = Pack<Elem>;
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int nvl = g.forward_nvl, nodes = g.num_ranks / nvl, my_node = g.rank / nvl, lane = lane_id();
  const int Kw = p.num_weights, n16 = p.row_bytes / 16;
  const uint32_t epoch = current_epoch(g);
  char* self = self_base(g);
  bool put_any = false;
  const int64_t total = static_cast<int64_t>(nodes - 1) * p.num_tokens;  // nodes >= 2 in a forwarding group
  for (int64_t item = global_warp(); item < total; item += num_global_warps()) {
    int n, t;
    other_node_item(item, nodes, my_node, &n, &t);
    const int64_t fslot = forward_slot(B, n, my_node, t);
    const uint32_t mask = __ldcg(reinterpret_cast<const uint32_t*>(self + B.fwd_meta + fslot * B.fwd_stride));
    if (mask == 0u) continue;  // no rank of this node kept token t of source (n, my local index)
    // the partial is staged and sent in the values' dtype (bf16: 2H bytes per (token, node) over RDMA, like the
    // rows it replaces; the f32 sum is rounded once here and once more at the source, SPEC's tolerance)
    // kForwardUnroll vectors per lane in flight per contributor (one at a time left the warp waiting on each load:
    // the kernel was latency-bound); each element's sum keeps the local-index order.
    int4* part = reinterpret_cast<int4*>(self + B.send_rows + fslot * B.payload_stride);
    for (int base = lane; base < n16; base += 32 * kForwardUnroll) {
      float acc[kForwardUnroll][Pk::kN];
#pragma unroll
      for (int u = 0; u < kForwardUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < Pk::kN; ++e) acc[u][e] = 0.0f;
      }
      for (uint32_t m = mask; m != 0u; m &= m - 1u) {
        const int i = __ffs(m) - 1;
        const int4* src = reinterpret_cast<const int4*>(
            self + B.payload + ((static_cast<int64_t>(n) * nvl + i) * p.max_tokens_per_rank + t) * p.row_bytes);
        int4 v[kForwardUnroll];
#pragma unroll
        for (int u = 0; u < kForwardUnroll; ++u)
          if (base + 32 * u < n16) v[u] = ld_cg_v4(src + base + 32 * u);
#pragma unroll
        for (int u = 0; u < kForwardUnroll; ++u)
          if (base + 32 * u < n16) Pk::add(acc[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kForwardUnroll; ++u)
        if (base + 32 * u < n16) part[base + 32 * u] = Pk::pack(acc[u]);
    }
    float* s_w = reinterpret_cast<float*>(self + B.send_weights) + fslot * Kw;
    if (lane < Kw) {
      float wacc = 0.0f;
      for (uint32_t m = mask; m != 0u; m &= m - 1u) {
        const int i = __ffs(m) - 1;
        wacc += __ldcg(reinterpret_cast<const float*>(self + B.topk_weights) +
                       ((static_cast<int64_t>(n) * nvl + i) * p.max_tokens_per_rank + t) * Kw + lane);
      }
      s_w[lane] = wacc;
    }
    __threadfence();  // the staged partials are in memory before the puts read them
    __syncwarp();
    const int pe = pe_of(g, n * nvl + g.rank % nvl);
    const int64_t dslot = forward_slot(B, my_node, n, t);  // at the source, of node n
    put_plain(self + B.fwd_rows + dslot * B.payload_stride, reinterpret_cast<const char*>(part), p.row_bytes, pe);
    if (Kw > 0) put_plain(self + B.fwd_meta + dslot * B.fwd_stride + 4, reinterpret_cast<const char*>(s_w), 4 * Kw, pe);
    put_any = true;
  }
  if (put_any) nvshmem_quiet();
  finish_and_announce(g, epoch, kAnnounceForwarders);
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
__global__ void __launch_bounds__(32, 1) rdma_wait_data_kernel(const __grid_constant__ GroupCtx g, int which) {
  const int s = threadIdx.x;
  if (s >= g.num_ranks) return;
  if (is_remote(g, s)) {
    if (which == kWaitNode || (which == kWaitForwarders && s % g.forward_nvl != g.rank % g.forward_nvl)) return;
    wait_complete_and_reset(rdma_word(g, SignalHeader::kRdmaData, s), g, "receive (NVSHMEM, data from peers)", s);
  } else if (which != kWaitForwarders) {
    wait_peer(g, s, SignalHeader::kDataFlag, current_epoch(g), "receive (data from peers)");
  }
}

int clamp_blocks(int n) { return n < 1 ? 1 : (n > 4096 ? 4096 : n); }

// ---- launchers (the NormalRdmaOps entries) ------------------------------------------------------------------------
const char* barrier(const GroupCtx& g, cudaStream_t stream) {
  rdma_barrier_kernel<<<1, 32, 0, stream>>>(g);
  return launch_error("normal-mode barrier (NVSHMEM)");
}

const char* dispatch_notify(const DispatchParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(p.num_experts);
  rdma_notify_kernel<<<1, kLayoutThreads, smem, stream>>>(p);
  return launch_error("dispatch notify (NVSHMEM)");
}

// Dispatch / cached dispatch: send, and (hierarchical) forward, until every row of the op is in this rank's staging.
const char* send_and_receive_rows(const SendArgs& a, int blocks, cudaStream_t stream) {
  // Test hook JAX_EP_TEST_WIDE_SEND=1: the 32-slot instance for any R, so that the sanitizer runs cover it on 2 GPUs.
  static const bool wide = [] {
    const char* v = std::getenv("JAX_EP_TEST_WIDE_SEND");
    return v != nullptr && v[0] == '1';
  }();
  if (a.g.num_ranks <= kMaxNvlPeers && !wide)
    rdma_send_rows_kernel<kMaxNvlPeers><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(a);
  else
    rdma_send_rows_kernel<kMaxGroupRanks><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(a);
  if (const char* err = launch_error("dispatch send (NVSHMEM)")) return err;
  if (a.g.forward_nvl > 0) {
    rdma_wait_data_kernel<<<1, 32, 0, stream>>>(a.g, kWaitForwarders);
    if (const char* err = launch_error("dispatch forward wait (NVSHMEM)")) return err;
    rdma_forward_kernel<<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(a);
    if (const char* err = launch_error("dispatch forward (NVLink)")) return err;
  }
  rdma_wait_data_kernel<<<1, 32, 0, stream>>>(a.g, a.g.forward_nvl > 0 ? kWaitNode : kWaitAll);
  return launch_error("normal-mode receive wait (NVSHMEM)");
}

// Combine: send (node-first: inside the node, then the forwarders' partial sums across nodes) until every row or
// partial of this rank's tokens is in its staging; the reduction follows in stream order.
const char* combine_send_and_receive(const CombineParams& p, int blocks, cudaStream_t stream) {
  rdma_combine_send_kernel<<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(p);
  if (const char* err = launch_error("combine send (NVSHMEM)")) return err;
  if (p.g.forward_nvl > 0) {
    rdma_wait_data_kernel<<<1, 32, 0, stream>>>(p.g, kWaitNode);
    if (const char* err = launch_error("combine node wait")) return err;
    if (p.dtype == CombineDtype::kBF16)
      rdma_combine_forward_kernel<__nv_bfloat16><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(p);
    else
      rdma_combine_forward_kernel<float><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(p);
    if (const char* err = launch_error("combine forward (NVSHMEM)")) return err;
  }
  rdma_wait_data_kernel<<<1, 32, 0, stream>>>(p.g, p.g.forward_nvl > 0 ? kWaitForwarders : kWaitAll);
  return launch_error("normal-mode receive wait (NVSHMEM)");
}

const NormalRdmaOps kOps = {kNormalRdmaAbi, &barrier, &dispatch_notify, &send_and_receive_rows,
                            &combine_send_and_receive};

}  // namespace

const NormalRdmaOps* normal_ops() { return &kOps; }

Status preload_normal_kernels() {
  return preload({reinterpret_cast<const void*>(rdma_barrier_kernel), reinterpret_cast<const void*>(rdma_notify_kernel),
                  reinterpret_cast<const void*>(rdma_send_rows_kernel<kMaxNvlPeers>),
                  reinterpret_cast<const void*>(rdma_send_rows_kernel<kMaxGroupRanks>),
                  reinterpret_cast<const void*>(rdma_combine_send_kernel),
                  reinterpret_cast<const void*>(rdma_forward_kernel),
                  reinterpret_cast<const void*>(rdma_combine_forward_kernel<__nv_bfloat16>),
                  reinterpret_cast<const void*>(rdma_combine_forward_kernel<float>),
                  reinterpret_cast<const void*>(rdma_wait_data_kernel)});
}

}  // namespace jax_ep::rdma
