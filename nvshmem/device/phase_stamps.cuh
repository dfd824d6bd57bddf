// Test hook JAX_EP_TEST_LOW_LATENCY_PHASES=1 (preload_kernels arms it): the NVSHMEM low-latency kernels (low_latency.cu) add,
// at named points, the time since their block started to device sums, so a bench can split a kernel's duration
// into phases (python -m jax_ep.bench.chain_gaps prints them). Thread 0 of a block stamps; a phase of "each block"
// averages over blocks, a phase of "the last block" is timed from that block's own start. %globaltimer is one
// device-wide clock, so stamps of different blocks compare. Off (one load of g_time_phases per stamp in thread 0)
// unless armed.
// NOTE: only for TUs of jax_ep._jax_ep_nvshmem (relocatable device code: the sums are defined once, in low_latency.cu).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_ep::nvshmem {

enum LowLatencyPhase : int {
  kPhaseSendConsumed = 0,  // dispatch send, each block: its last warp's consumed wait (lane 0: peer 0) done
  kPhaseSendStaged,        // dispatch send, each block's first token: its message in the send slot (block barrier)
  kPhaseSendPut,           // dispatch send, each block's first token: every part put (block barrier)
  kPhaseSendLast,          // dispatch send, last block: every block counted itself
  kPhaseSendAnnounced,     // dispatch send, last block: every expert's count announced (block barrier)
  kPhaseRecvWaited,        // receive, each block: thread 0's signal word complete (dispatch: source 0; combine: its
                           // token's first expert)
  kPhaseRecvBody,          // receive, each block: body done (thread 0)
  kPhaseRecvLast,          // receive, last block: every block counted itself
  kPhaseRecvReset,         // receive, last block: every signal word of the half complete and reset (block barrier)
  kPhaseRecvConsumed,      // receive, last block: the consumed counts added at every rank
  kLowLatencyPhases
};

extern __device__ uint32_t g_time_phases;
extern __device__ unsigned long long g_phase_ns[kLowLatencyPhases];
extern __device__ unsigned long long g_phase_hits[kLowLatencyPhases];

// This block's start, written by thread 0 before the kernel's first __syncthreads, read after it.
__device__ __forceinline__ uint64_t& block_start_ns() {
  __shared__ uint64_t start;
  return start;
}

__device__ __forceinline__ void phase_begin() {
  if (threadIdx.x == 0 && g_time_phases) block_start_ns() = global_timer_ns();
}

__device__ __forceinline__ void phase_add(LowLatencyPhase phase) {
  atomicAdd(&g_phase_ns[phase], static_cast<unsigned long long>(global_timer_ns() - block_start_ns()));
  atomicAdd(&g_phase_hits[phase], 1ull);
}

__device__ __forceinline__ void phase_stamp(LowLatencyPhase phase) {
  if (threadIdx.x == 0 && g_time_phases) phase_add(phase);
}

// phase_stamp from lane 0 of the calling warp (a phase that a warp other than warp 0 reaches), timed from this
// block's start as thread 0 recorded it (phase_begin runs before the block's first __syncthreads).
__device__ __forceinline__ void phase_stamp_lane0(LowLatencyPhase phase) {
  if ((threadIdx.x & 31u) == 0 && g_time_phases) phase_add(phase);
}

}  // namespace jax_ep::nvshmem
