// The NVSHMEM device-API check of jax_ep._jax_ep_nvshmem: a small all-to-all over counted signals
// (counted_signal.cuh) run by every PE at initialize, so a broken device library, device state or transport shows up
// as an error there and not inside the first real call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "jax_ep/macros.h"
#include "jax_ep/status.h"

namespace jax_ep::nvshmem {

// What one PE saw (CheckResult::kWords int32 words, written by the kernel).
struct CheckResult {
  static constexpr int kWords = 8;
  int32_t my_pe;            // nvshmem_my_pe() on the device
  int32_t n_pes;            // nvshmem_n_pes() on the device
  int32_t complete;         // senders whose counted signal completed within the timeout (want n_pes)
  int32_t bad_payloads;     // messages whose bytes differ from what their sender wrote
  int32_t bad_counts;       // senders whose count differs from the expected one
  int32_t first_missing;    // lowest sender that did not complete, -1 if none
  uint32_t missing_low;     // that sender's signal word as last read (low, high halves)
  uint32_t missing_high;
};
static_assert(sizeof(CheckResult) == CheckResult::kWords * 4, "CheckResult is read as int32 words");

// Messages PE `src` sends to PE `dst` in the check (1 to 3, different per pair, so counts are checked too).
JAX_EP_HD int32_t check_messages(int src, int dst) { return 1 + (src + dst) % 3; }
constexpr int kCheckMaxMessages = 3;

// Bytes of the symmetric buffer the check needs for n_pes PEs.
size_t check_buffer_bytes(int n_pes);

// Launches the check on `stream` over the zeroed symmetric buffer `buf` (check_buffer_bytes) and writes the result
// to `result` (device memory). Every PE must launch it; each waits at most timeout_ns for the others.
Status launch_device_check(char* buf, int n_pes, uint64_t timeout_ns, CheckResult* result, cudaStream_t stream);

}  // namespace jax_ep::nvshmem
