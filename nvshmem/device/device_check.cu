// The device-API check (device_check.h): every PE sends check_messages(me, d) 16-byte messages to every PE d
// (itself included) with put-with-signal ADD 1, announces the count with a signal ADD, then waits for every sender's
// counted signal and checks counts and bytes. One block; it exercises exactly the calls the internode kernels use.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <string>

#include "device/counted_signal.cuh"
#include "device/device_check.h"

namespace jax_ep::nvshmem {
namespace {

constexpr int kThreads = 256;
constexpr int32_t kMagic = 0x6a617865;  // "jaxe"

// Buffer layout: signals [n] u64 | inbox [n][kCheckMaxMessages] int4 (from each sender) | outbox [n][...] int4.
__host__ __device__ inline size_t inbox_offset(int n) { return (static_cast<size_t>(n) * 8 + 15) / 16 * 16; }
__host__ __device__ inline size_t outbox_offset(int n) {
  return inbox_offset(n) + static_cast<size_t>(n) * kCheckMaxMessages * 16;
}

__global__ void __launch_bounds__(kThreads) device_check_kernel(char* buf, uint64_t timeout_ns, CheckResult* out) {
  const int me = nvshmem_my_pe(), n = nvshmem_n_pes(), tid = threadIdx.x;
  uint64_t* signals = reinterpret_cast<uint64_t*>(buf);
  int4* inbox = reinterpret_cast<int4*>(buf + inbox_offset(n));
  int4* outbox = reinterpret_cast<int4*>(buf + outbox_offset(n));
  __shared__ int32_t s_complete, s_bad_payloads, s_bad_counts, s_first_missing;
  __shared__ uint64_t s_missing_word;
  if (tid == 0) {
    s_complete = s_bad_payloads = s_bad_counts = 0;
    s_first_missing = n;
    s_missing_word = 0;
  }
  for (int i = tid; i < n * kCheckMaxMessages; i += kThreads) {
    const int d = i / kCheckMaxMessages, j = i % kCheckMaxMessages;
    outbox[i] = make_int4(me, j, d, kMagic);
  }
  __syncthreads();
  // Message j to PE d lands in d's inbox row of this sender; its signal ADD 1 arrives after its bytes.
  for (int i = tid; i < n * kCheckMaxMessages; i += kThreads) {
    const int d = i / kCheckMaxMessages, j = i % kCheckMaxMessages;
    if (j >= check_messages(me, d)) continue;
    nvshmem_putmem_signal_nbi(inbox + me * kCheckMaxMessages + j, outbox + i, sizeof(int4), signals + me, 1,
                              NVSHMEM_SIGNAL_ADD, d);
  }
  for (int d = tid; d < n; d += kThreads)  // the count, unordered against the messages (counted_signal.cuh)
    nvshmemx_signal_op(signals + me, announce_value(static_cast<uint32_t>(check_messages(me, d))),
                       NVSHMEM_SIGNAL_ADD, d);
  for (int s = tid; s < n; s += kThreads) {
    uint64_t seen = 0;
    if (!wait_complete(signals + s, timeout_ns, &seen)) {
      atomicMin(&s_first_missing, s);
      if (s_first_missing == s) s_missing_word = seen;  // racy only among missing senders: any of them will do
      continue;
    }
    __threadfence();  // the signal was seen before the bytes are read
    atomicAdd(&s_complete, 1);
    const int32_t m = check_messages(s, me);
    if (announced(seen) != static_cast<uint32_t>(m)) atomicAdd(&s_bad_counts, 1);
    for (int j = 0; j < m; ++j) {
      const int4 v = __ldcv(inbox + s * kCheckMaxMessages + j);  // volatile: written by another PE
      if (v.x != s || v.y != j || v.z != me || v.w != kMagic) atomicAdd(&s_bad_payloads, 1);
    }
  }
  __syncthreads();
  if (tid == 0) {
    nvshmem_quiet();  // this PE's puts and signals are complete before the kernel ends
    out->my_pe = me;
    out->n_pes = n;
    out->complete = s_complete;
    out->bad_payloads = s_bad_payloads;
    out->bad_counts = s_bad_counts;
    out->first_missing = s_first_missing < n ? s_first_missing : -1;
    out->missing_low = static_cast<uint32_t>(s_missing_word);
    out->missing_high = static_cast<uint32_t>(s_missing_word >> kAnnounceShift);
  }
}

}  // namespace

size_t check_buffer_bytes(int n_pes) {
  return outbox_offset(n_pes) + static_cast<size_t>(n_pes) * kCheckMaxMessages * 16;
}

Status launch_device_check(char* buf, int n_pes, uint64_t timeout_ns, CheckResult* result, cudaStream_t stream) {
  (void)n_pes;  // the kernel asks NVSHMEM; the caller sized the buffer with check_buffer_bytes(n_pes)
  device_check_kernel<<<1, kThreads, 0, stream>>>(buf, timeout_ns, result);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Status::Error(std::string("NVSHMEM device check launch failed: ") + cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace jax_ep::nvshmem
