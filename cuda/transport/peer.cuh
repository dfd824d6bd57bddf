// Device side of the peer transport (both process models): the narrow interface the kernels use.
//   peer_base(g, r)        load/store pointer to rank r's staging buffer (NVLink peer mapping, or this GPU's own)
//   group_arrive_block()   this rank has entered this op (monotonic counters, no reset between calls)
//   group_barrier_block()  ... and every rank has
//   signal_peer()          publish "my writes to you for this epoch are done" (release, system scope)
//   wait_peer()            bounded acquire wait for such a signal
// An NVSHMEM transport (one process per GPU) provides the same four with nvshmem_ptr-filled PeerTables.
//
// Memory ordering: writes to a peer are followed by a st.release.sys of the epoch to the peer's flag word, by the
// writing thread or by one ordered after the writers (__syncthreads, or the GPU-scope acq_rel tickets of
// common/last_block.cuh that the releasing block's ticket acquired): a release is cumulative, so no separate fence
// precedes it (a system-scope fence is costly with peer stores in flight: docs/BENCHMARKS.md "Signal cost"). The
// reader spins with ld.acquire.sys, then a __syncthreads() orders the rest of its block, and peer-written data is
// read with L1-bypassing loads (ld.cg): L1 is not coherent with peer stores.
#pragma once

#include <cstdint>

#include "common/last_block.cuh"
#include "common/ptx.cuh"
#include "common/thread.cuh"
#include "jax_ep/constants.h"
#include "jax_ep/group_ctx.h"
#include "jax_ep/signal_header.h"

namespace jax_ep {

// NOTE: every kernel takes its parameters as `const __grid_constant__`, so a dynamic index reads the table straight
// from the kernel's parameter space (the constant bank); on a by-value parameter without it, the compiler would copy
// the whole struct to local memory; an unrolled compare-and-select over kMaxGroupRanks entries would spill.
__device__ __forceinline__ char* peer_base(const GroupCtx& g, int r) { return g.peers.base[r]; }

__device__ __forceinline__ char* self_base(const GroupCtx& g) { return peer_base(g, g.rank); }

__device__ __forceinline__ uint32_t* header_word(char* base, int64_t byte_offset) {
  return reinterpret_cast<uint32_t*>(base + byte_offset);
}

// Epoch of the op in flight on this device (set by the op's barrier, read by its later kernels).
__device__ __forceinline__ uint32_t current_epoch(const GroupCtx& g) {
  return *reinterpret_cast<volatile uint32_t*>(self_base(g) + SignalHeader::kBarrierEpoch);
}

// Called by every thread of one block (any blockDim: thread i serves ranks i, i + blockDim, ...): takes this op's
// epoch and tells every rank that this rank has entered the op, without waiting for anyone. Returns the new epoch.
// release: the arrival orders this rank's earlier writes before it (a barrier's); without, it only counts the op
// (a later barrier's release arrival orders them).
// NOTE: barrier_in[s] on rank r counts the ops rank s has entered; barrier_epoch counts the ops rank r has entered.
// Both only grow (wrap-safe compares), so no host reset is ever needed and CUDA-graph replays stay correct. Every op
// arrives exactly once, so on every rank the epoch of an op is the same number.
__device__ __forceinline__ uint32_t group_arrive_block(const GroupCtx& g, bool release) {
  char* self = self_base(g);
  const uint32_t epoch = current_epoch(g) + 1;
  __syncthreads();  // everyone has read the old epoch before thread 0 advances it below
  for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x) {
    uint32_t* word = header_word(peer_base(g, s), SignalHeader::kBarrierIn + 4 * g.rank);
    if (release)
      red_add_release_sys(word, 1u);
    else
      red_add_relaxed_sys(word, 1u);
  }
  if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(self + SignalHeader::kBarrierEpoch) = epoch;
  return epoch;
}

// group_arrive_block, then the wait until every rank has entered this op. Returns the new epoch.
// NOTE: a rank can be at most one op ahead of a peer: it cannot pass the next barrier, or the count exchange of a
// dispatch, before the peer arrives there.
__device__ __forceinline__ uint32_t group_barrier_block(const GroupCtx& g, const char* what) {
  const uint32_t epoch = group_arrive_block(g, true);
  for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x)
    wait_reached(header_word(self_base(g), SignalHeader::kBarrierIn + 4 * s), epoch, g.timeout_ns, what, g.rank, s);
  __syncthreads();
  return epoch;
}

__device__ __forceinline__ void signal_peer(const GroupCtx& g, int peer, int64_t flag_offset, uint32_t epoch) {
  st_release_sys(header_word(peer_base(g, peer), flag_offset + 4 * g.rank), epoch);
}

__device__ __forceinline__ void wait_peer(const GroupCtx& g, int peer, int64_t flag_offset, uint32_t epoch,
                                          const char* what) {
  wait_reached(header_word(self_base(g), flag_offset + 4 * peer), epoch, g.timeout_ns, what, g.rank, peer);
}

// Work items of a kernel, one per warp at a time: the first round is static (item = the warp's index among the
// item takers, no atomic at the start, when every warp would hit the counter at once); after it a warp that finishes
// takes the next item from a counter word (one atomic add by lane 0), so blocks whose stores drain faster are not
// left idle while others still hold a fixed share. With at most one round of items there is no atomic.
// An ItemQueue is the blocks that take one kind of item: the whole grid on kNextItem (grid_items), or one role of a
// kernel whose blocks split into roles, each on its own word (blocks outside the role may take items past the first
// round with next_item). Every kernel that takes items ends in a last block that puts its counters back to 0
// (last_items_block for grid_items).
struct ItemQueue {
  uint32_t* counter;
  int blocks;  // blocks taking these items
  int block;   // this block's index among them
};
__device__ __forceinline__ ItemQueue grid_items(const GroupCtx& g) {
  return {header_word(self_base(g), SignalHeader::kNextItem), static_cast<int>(gridDim.x), static_cast<int>(blockIdx.x)};
}
__device__ __forceinline__ int first_item(const ItemQueue& q) { return q.block * num_warps() + warp_id(); }
__device__ __forceinline__ int64_t next_item(const ItemQueue& q, int64_t items) {
  const int64_t round = static_cast<int64_t>(q.blocks) * num_warps();
  if (items <= round) return items;
  uint32_t taken = 0;
  if (lane_id() == 0) taken = atomicAdd(q.counter, 1u);
  return round + __shfl_sync(0xffffffffu, taken, 0);
}

// last_block (GPU-scope tickets) of a kernel that took next_item: true in the last block, which has put kNextItem
// back to 0 (every warp's last add precedes its block's ticket). Called by every thread of every block.
__device__ __forceinline__ bool last_items_block(const GroupCtx& g) {
  __shared__ int32_t s_last;
  if (!last_block<TicketScope::kGpu>(header_word(self_base(g), SignalHeader::kBlockDone), &s_last)) return false;
  if (threadIdx.x == 0) *header_word(self_base(g), SignalHeader::kNextItem) = 0u;
  return true;
}

// End of a kernel that took its items from grid_items (next_item) and wrote rows into peers: the last block to
// finish (last_items_block, which also puts kNextItem back to 0) tells every rank that all rows of this op from this
// rank are in place (its threads signal the ranks in parallel). Called by every thread of every block. Returns true
// in the last block.
__device__ __forceinline__ bool finish_and_signal_data(const GroupCtx& g, uint32_t epoch) {
  // GPU-scope tickets: each signal is a release at system scope, cumulative over every block's stores and loads
  if (!last_items_block(g)) return false;
  for (int d = threadIdx.x; d < g.num_ranks; d += blockDim.x) signal_peer(g, d, SignalHeader::kDataFlag, epoch);
  return true;
}

}  // namespace jax_ep
