// The last block of a grid to finish: every block takes one ticket from a counter at its end, and the block that takes
// the last one goes on (to signal peers, publish counts, or add up the other blocks' partial results).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_ep {

// What a block's ticket orders before the last block goes on. In both, the __syncthreads before thread 0 takes the
// ticket orders every load and store of the block before it.
//   kGpu     the ticket is an acq_rel add at GPU scope: each ticket releases its block's work and the last one
//            acquires all of it. A release by any thread of the last block after last_block returns is cumulative
//            over that work, so one st.release.sys signal publishes every block's peer stores to a peer that
//            acquires it at system scope (the NVLink kernels' signals: transport/peer.cuh).
//   kSystem  each block fences at system scope (__threadfence_system) before its ticket: every block's work is
//            performed at system scope before the last block goes on (the NVSHMEM kernels, which announce with
//            NVSHMEM signal operations).
enum class TicketScope { kGpu, kSystem };

// Called by every thread of each of `blocks` blocks (the kernel's grid, or the blocks of one role of a kernel that
// plays several: each role its own counter), once per block, at its end. Returns true in every thread of the block
// that took the last ticket (once every block has taken one) and false in every thread of the others; the counter is
// back at 0 for the next kernel (kernels using one counter run one after another). s_last: one int of the caller's
// shared memory.
// A single block takes no ticket (kGpu): the __syncthreads orders every thread's work before what the block does
// next, and a release by any of its threads is cumulative over it, as above.
template <TicketScope kScope>
__device__ __forceinline__ bool last_block(uint32_t* counter, int32_t* s_last, uint32_t blocks) {
  __syncthreads();
  if constexpr (kScope == TicketScope::kGpu) {
    if (blocks == 1) return true;  // uniform over the blocks
  }
  if (threadIdx.x == 0) {
    if constexpr (kScope == TicketScope::kSystem) {
      __threadfence_system();
      *s_last = atomicAdd(counter, 1u) == blocks - 1;
    } else {
      *s_last = atom_add_acq_rel_gpu(counter, 1u) == blocks - 1;
    }
    if (*s_last) {
      atomicExch(counter, 0u);
      if constexpr (kScope == TicketScope::kSystem) __threadfence();  // the other blocks' counts before what follows
    }
  }
  __syncthreads();
  return *s_last != 0;
}

// The kernel's whole grid.
template <TicketScope kScope>
__device__ __forceinline__ bool last_block(uint32_t* counter, int32_t* s_last) {
  return last_block<kScope>(counter, s_last, gridDim.x * gridDim.y);
}

}  // namespace jax_ep
