// The phases of the NVSHMEM low-latency kernels (low_latency.cu) for the test hook JAX_EP_TEST_PHASES=1
// (common/phase_stamps.cuh), armed by preload_kernels.
// NOTE: only for TUs of jax_ep._jax_ep_nvshmem (relocatable device code: the sums are defined once, in low_latency.cu).
#pragma once

#include <cstdint>

#include "common/phase_stamps.cuh"

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
static_assert(kLowLatencyPhases <= kMaxPhases, "PhaseSums holds every phase");

// The sums (common/phase_stamps.cuh), defined once, in low_latency.cu.
extern __device__ PhaseSums g_low_latency_phases;

}  // namespace jax_ep::nvshmem
