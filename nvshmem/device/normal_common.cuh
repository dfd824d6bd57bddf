// Device helpers shared by the normal-mode NVSHMEM kernels (normal_send.cu: barrier, notify, send, wait;
// normal_forward.cu: the hierarchical forwarders), and the forwarders' launchers.
// Word ownership: the kNvshmem* words of a pair are only touched by NVSHMEM signal ops of the remote peer and by this
// rank's own loads / resets; the NVLink words only by GPU stores and atomics of direct peers.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdio>

#include "device/counted_signal.cuh"
#include "jax_ep/status.h"
#include "kernels/normal_device.cuh"

namespace jax_ep::nvshmem {
namespace {

using namespace jax_ep::normal;  // NOLINT

__device__ __forceinline__ bool is_remote(const GroupCtx& g, int d) { return g.remote.test(d); }

// NVSHMEM PE of rank d (a dynamic index into the __grid_constant__ parameter: transport/peer.cuh, peer_base).
__device__ __forceinline__ int pe_of(const GroupCtx& g, int d) { return g.pe[d]; }

__device__ __forceinline__ uint64_t* nvshmem_word(const GroupCtx& g, int64_t offset, int index) {
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
      if (first_timeout_report())
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
    if (first_timeout_report())
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
        nvshmemx_signal_op(nvshmem_word(g, SignalHeader::kNvshmemData, g.rank), announce_value(0), NVSHMEM_SIGNAL_ADD,
                           pe_of(g, d));
    } else if (to != kAnnounceForwarders) {
      signal_peer(g, d, SignalHeader::kDataFlag, epoch);
    }
  }
}

// Work item `item` of a forwarder's grid-stride loop over (other node, token) pairs: node n != my_node, token t.
// The items enumerate only the other nodes: a loop over every node that skipped this node's items would leave idle
// every warp whose index draws only this node (warp w draws node w % nodes when the warp count divides by it).
__device__ __forceinline__ void other_node_item(int64_t item, int nodes, int my_node, int* n, int* t) {
  const int k = static_cast<int>(item % (nodes - 1));
  *n = k + (k >= my_node ? 1 : 0);
  *t = static_cast<int>(item / (nodes - 1));
}

inline int clamp_blocks(int n) { return n < 1 ? 1 : (n > 4096 ? 4096 : n); }

}  // namespace

// normal_forward.cu: the forwarders' launches and their preload (the NormalNvshmemOps launchers call them).
const char* launch_dispatch_forward(const normal::SendArgs& a, int blocks, cudaStream_t stream);
const char* launch_combine_forward(const normal::CombineParams& p, int blocks, cudaStream_t stream);
Status preload_forward_kernels();

}  // namespace jax_ep::nvshmem
