// Test hooks of the handlers: a count of the calls that launch kernels (tests/gpu/test_command_buffers_cuda.py) and
// an absent rank read once per process from the environment (tests/gpu/test_faults_cuda.py).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace jax_ep::test_hooks {

struct AbsentRank {
  int64_t rank = -1;   // -1: the hook is off
  int64_t after = 0;   // launches of that rank that still run
};

inline AbsentRank read_absent_rank() {
  AbsentRank h;
  const char* v = std::getenv("JAX_EP_TEST_ABSENT_RANK");
  if (v == nullptr || *v == '\0') return h;
  h.rank = std::strtol(v, nullptr, 10);
  if (const char* colon = std::strchr(v, ':')) h.after = std::strtol(colon + 1, nullptr, 10);
  return h;
}

// JAX_EP_TEST_ABSENT_RANK=r[:n]: the device of rank r launches nothing from its (n+1)-th kernel-launching handler call
// on (n = 0 when omitted; a fused op is one call): its ops return at once, as if its kernels never arrived, so its
// peers' device waits time out (the fault case "one GPU's kernel never arrives" in a process driving several GPUs). It
// counts handler calls, so XLA command buffers (replays call no handler) must be off. Unset: never absent.
inline bool absent(int32_t rank) {
  static const AbsentRank hook = read_absent_rank();
  static std::atomic<int64_t> launches{0};
  if (hook.rank < 0 || rank != hook.rank) return false;
  return launches.fetch_add(1, std::memory_order_relaxed) >= hook.after;
}

// Handler calls that launch kernels, over every device of this process. XLA command buffers replay recorded launches
// without calling the handler: a count that stops growing while steps run means the calls replay from a CUDA graph.
inline std::atomic<int64_t>& launching_calls() {
  static std::atomic<int64_t> calls{0};
  return calls;
}

// Called once by every handler call that launches kernels, before it launches: counts the call; true when the
// absent-rank hook says rank r launches nothing.
inline bool skip_launch(int32_t rank) {
  launching_calls().fetch_add(1, std::memory_order_relaxed);
  return absent(rank);
}

}  // namespace jax_ep::test_hooks
