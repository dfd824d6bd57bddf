// Counted signals: how a receiver knows that every message of a sender has landed, using only the portable
// NVSHMEM device API and non-fetching adds (docs/INTERNODE.md section 2: the RDMA leg of the internode kernels).
//
// One 64-bit signal word per (receiver slot, sender), in the receiver's symmetric memory, zero when idle:
//   low 32 bits   messages arrived: every message is a put-with-signal that ADDs 1 (NVSHMEM delivers a put's signal
//                 after its data, on every transport);
//   high 32 bits  count announced + 1: the sender ADDs (n + 1) << 32 once it knows how many messages it sends (n),
//                 at any time, before or after the messages themselves.
// Complete  <=>  high != 0 and low == high - 1. Neither signal has to be ordered against the other, so there is no
// fence between data and count (the one an unordered transport such as EFA would need before a plain flag), and no
// signal SET (which IBRC/UCX only do with GDRCopy). The receiver resets its word to 0 after reading the data and
// before it tells the senders that the slot may be reused.
// NOTE: only for TUs of jax_ep._jax_ep_nvshmem, the one binary linked with NVSHMEM's device library.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "common/ptx.cuh"

namespace jax_ep::nvshmem {

constexpr uint64_t kAnnounceShift = 32;

// The ADD that announces n messages.
__device__ __forceinline__ uint64_t announce_value(uint32_t n) {
  return static_cast<uint64_t>(n + 1u) << kAnnounceShift;
}

__device__ __forceinline__ bool complete(uint64_t word) {
  const uint32_t hi = static_cast<uint32_t>(word >> kAnnounceShift), lo = static_cast<uint32_t>(word);
  return hi != 0u && lo == hi - 1u;
}

// Messages announced by a complete word.
__device__ __forceinline__ uint32_t announced(uint64_t word) {
  return static_cast<uint32_t>(word >> kAnnounceShift) - 1u;
}

// Spins (NVSHMEM's signal fetch: a volatile load of the local word) until the word is complete or timeout_ns has
// passed. Returns whether it completed; *seen = the last value read.
__device__ __forceinline__ bool wait_complete(uint64_t* word, uint64_t timeout_ns, uint64_t* seen) {
  uint64_t v = nvshmem_signal_fetch(word);
  if (complete(v)) {
    *seen = v;
    return true;
  }
  const uint64_t start = global_timer_ns();
  while (!complete(v = nvshmem_signal_fetch(word))) {
    if (global_timer_ns() - start > timeout_ns) {
      *seen = v;
      return false;
    }
  }
  *seen = v;
  return true;
}

}  // namespace jax_ep::nvshmem
