// Loads kernels into the current device's context ahead of their first launch. With CUDA lazy module loading (the
// default since CUDA 12), the first launch of each kernel otherwise pays for loading it (~ms): the prewarm hook
// (jax_ep.initialize -> warm-up) calls the preload functions on every device so the first op runs at full speed.
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>

#include "jax_ep/status.h"

namespace jax_ep {

// kernels: the __global__ functions, each cast with reinterpret_cast<const void*>.
inline Status preload(std::initializer_list<const void*> kernels) {
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, k));
  }
  return Status::Ok();
}

}  // namespace jax_ep
