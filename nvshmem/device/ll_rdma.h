// The NVSHMEM low-latency kernels of this module (ll_rdma.cu), as the table jax_ep._jax_ep_native launches them
// through (jax_ep/rdma_ops.h).
#pragma once

#include "jax_ep/rdma_ops.h"

namespace jax_ep::rdma {

const LowLatencyRdmaOps* low_latency_ops();

}  // namespace jax_ep::rdma
