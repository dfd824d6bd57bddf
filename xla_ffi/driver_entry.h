// CUDA driver functions through the runtime: the native module links no libcuda, so each driver call it makes is
// looked up once by name (cudaGetDriverEntryPointByVersion, CUDA 12.0 ABI).
#pragma once

#include <cuda_runtime_api.h>

namespace jax_ep {

// The driver function `name` (cuda.h's signature for CUDA 12.0), or nullptr when this driver has none.
inline void* driver_entry(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return f;
}

}  // namespace jax_ep
