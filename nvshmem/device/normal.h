// The NVSHMEM normal-mode kernels of this module (normal_send.cu), as the table jax_ep._jax_ep_native launches
// them through (jax_ep/nvshmem_ops.h: NormalNvshmemOps).
#pragma once

#include "jax_ep/nvshmem_ops.h"
#include "jax_ep/status.h"

namespace jax_ep::nvshmem {

const NormalNvshmemOps* normal_ops();

// Loads the five kernels into the current device's context (no lazy load inside the first real call).
Status preload_normal_kernels();

}  // namespace jax_ep::nvshmem
