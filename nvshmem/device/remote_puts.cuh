// What every NVSHMEM kernel set of this module (low_latency.cu, normal_send.cu) shares about its puts to remote ranks:
// the counted message (put-with-signal, +1 after the bytes), the plain put (completed by a quiet), the test hook's
// device byte counter, and the launch error text of the ops tables.
// NOTE: only for TUs of jax_ep._jax_ep_nvshmem (relocatable device code: the counter is defined once, in low_latency.cu).
#pragma once

#include <cuda_runtime_api.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>
#include <string>

#include "common/thread.cuh"

namespace jax_ep::nvshmem {

// Test hook JAX_EP_TEST_COUNT_REMOTE_BYTES=1 (preload_kernels arms it): bytes of rows this device put to remote
// peers (signals not included), so a test can check the traffic that crosses the node boundary.
extern __device__ uint32_t g_count_remote_bytes;
extern __device__ unsigned long long g_remote_bytes;

// A counted message to a remote peer, from a warp (every lane calls it): NVSHMEM put-with-signal, +1 on `word_sym`
// at `pe` after the bytes. `src` must be symmetric memory (a send slot), complete and fenced before the call.
__device__ __forceinline__ void put_counted(char* dst_sym, const char* src, int bytes, uint64_t* word_sym, int pe) {
  nvshmemx_putmem_signal_nbi_warp(dst_sym, src, bytes, word_sym, 1, NVSHMEM_SIGNAL_ADD, pe);
  if (g_count_remote_bytes && lane_id() == 0) atomicAdd(&g_remote_bytes, static_cast<unsigned long long>(bytes));
}

// A put to a remote peer from a warp (every lane calls it), completed later by the caller's nvshmem_quiet.
// `src` must be symmetric memory, complete and fenced before the call.
__device__ __forceinline__ void put_plain(char* dst_sym, const char* src, int bytes, int pe) {
  nvshmemx_putmem_nbi_warp(dst_sym, src, bytes, pe);
  if (g_count_remote_bytes && lane_id() == 0) atomicAdd(&g_remote_bytes, static_cast<unsigned long long>(bytes));
}

// nullptr after a good launch, else "<what> launch failed: ..." (valid until the next call on this thread).
inline const char* launch_error(const char* what) {
  thread_local std::string message;
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return nullptr;
  message = std::string(what) + " launch failed: " + cudaGetErrorString(e);
  return message.c_str();
}

}  // namespace jax_ep::nvshmem
