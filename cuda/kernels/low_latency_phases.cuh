// Phases of the NVLink low-latency kernels (low_latency_kernels.cu, low_latency_per_rank_kernels.cu) for the test hook
// JAX_EP_TEST_PHASES=1 (common/phase_stamps.cuh). Each translation unit that includes this header has its own sums
// (internal linkage: the main module is not linked with relocatable device code), armed by its preload_kernels and
// read by low_latency::phases, which adds them up.
#pragma once

#include "common/phase_stamps.cuh"

namespace jax_ep::low_latency {

enum LowLatencyNvlinkPhase : int {
  kPhaseSendOpened = 0,  // send, each block: the chain state read and the op decided (block barrier)
  kPhaseSendConsumed,    // send, each block: thread 0's wait for peer 0 to have consumed op n-2 done
  kPhaseSendSlots,       // dispatch send, each token: its destinations and positions found, its counts raised
  kPhaseSendQuantized,   // dispatch send, each fp8 token: its row quantized into shared memory (block barrier)
  kPhaseSendBody,        // send, each block: its rows stored (block barrier)
  kPhaseSendLast,        // send, last block: every block counted itself
  kPhaseSendPublished,   // send, last block: every count and flag stored (block barrier)
  kPhaseRecvOpened,      // receive, each block: the op decided (block barrier)
  kPhaseRecvBody,        // receive, each block: body done, waits for the flags included (block barrier)
  kPhaseRecvLast,        // receive, last block: every block counted itself
  kPhaseRecvReleased,    // receive, last block: "consumed" stored at every rank
  kLowLatencyNvlinkPhases
};
static_assert(kLowLatencyNvlinkPhases <= kMaxPhases, "PhaseSums holds every phase");

static __device__ PhaseSums g_ll_phases;

static PhaseDevices& ll_phase_devices() {
  static PhaseDevices d;
  return d;
}

inline const char* const* low_latency_phase_names() {
  static const char* const names[] = {"LL send: opened",         "LL send: peer 0 consumed op n-2",
                                      "LL dispatch send: token's slots found and counted",
                                      "LL dispatch send: token's row quantized",
                                      "LL send: rows stored",    "LL send: last block reached",
                                      "LL send: counts and flags published", "LL recv: opened",
                                      "LL recv: body done",      "LL recv: last block reached",
                                      "LL recv: consumed released"};
  static_assert(sizeof(names) / sizeof(names[0]) == kLowLatencyNvlinkPhases, "one name per phase");
  return names;
}

}  // namespace jax_ep::low_latency
