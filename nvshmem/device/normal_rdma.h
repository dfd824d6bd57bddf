// The NVSHMEM normal-mode kernels of this module (normal_rdma.cu), as the table jax_ep._jax_ep_native launches
// them through (jax_ep/rdma_ops.h: NormalRdmaOps).
#pragma once

#include "jax_ep/rdma_ops.h"
#include "jax_ep/status.h"

namespace jax_ep::rdma {

const NormalRdmaOps* normal_ops();

// Loads the five kernels into the current device's context (no lazy load inside the first real call).
Status preload_normal_kernels();

}  // namespace jax_ep::rdma
