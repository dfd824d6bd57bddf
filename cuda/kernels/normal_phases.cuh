// Phases of the NVLink normal-mode kernels (normal_kernels.cu, normal_combine.cuh) for the test hook
// JAX_EP_TEST_PHASES=1 (common/phase_stamps.cuh), armed by normal::preload_kernels and read by normal::phases.
// NOTE: for the one translation unit of those kernels (normal_kernels.cu): the sums have internal linkage.
#pragma once

#include "common/phase_stamps.cuh"

namespace jax_ep::normal {
namespace {

enum NormalPhase : int {
  kPhaseNotifyCleared = 0,  // notify, each block: its shared counts zeroed
  kPhaseNotifyChunk,        // notify, each block: its chunk of tokens laid out (block barrier)
  kPhaseNotifyLayout,       // notify: routing layout done (the last block: every chunk added up)
  kPhaseNotifyArrived,      // notify: this op's epoch taken, every rank told this rank entered it
  kPhaseNotifyPublished,    // notify: this thread's count words stored into every rank
  kPhaseNotifyExchanged,    // notify: every rank's count words of this op read (block barrier)
  kPhaseNotifyOutputs,      // notify: handle counts written
  kPhaseSendBlockDone,      // send rows, each (sender) block: its tokens stored (block barrier)
  kPhaseSendLastBlockDone,  // send rows, the last (sender) block: every sender's ticket taken, data signals stored
  kPhaseCombineBarrier,     // combine publish + barrier: done
  kPhaseCombineSendBlockDone,  // push combine, each sender block: its rows stored and counted (block barrier)
  kPhaseReduceBlockDone,    // combine reduce, each block (push: senders too, after their sends): its items summed
  kPhaseReduceLastBlockDone,  // combine reduce or push combine, the last block: every block's ticket taken (pull: done
                              // signals stored; push: arrival counters back to 0)
  kPhaseCopyBlockDone,      // send_copy_kernel, each block (senders too, after their sends): its rows copied out
  kPhaseCopyLastBlockDone,  // send_copy_kernel, the last block: every block's ticket taken, arrival counters reset
  kNormalPhases
};
static_assert(kNormalPhases <= kMaxPhases, "PhaseSums holds every phase");
__device__ PhaseSums g_normal_phases;
PhaseDevices& normal_phase_devices() {
  static PhaseDevices d;
  return d;
}

}  // namespace
}  // namespace jax_ep::normal
