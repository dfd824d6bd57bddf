// The low-latency kernels that move rows with NVSHMEM puts (EPConfig.allow_nvlink_for_low_latency=False; the RDMA
// leg of docs/INTERNODE.md) live in jax_ep._jax_ep_nvshmem, the one binary linked with NVSHMEM's device library
// (nvshmem/device/ll_rdma.cu). The FFI handlers live in jax_ep._jax_ep_native. This table joins them: the NVSHMEM
// module hands its address to the native module at initialize (runtime/nvshmem.py -> set_low_latency_rdma_ops), and
// the LL handlers launch through it, with the same parameter structs as the NVLink kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jax_ep/ll_params.h"
#include "jax_ep/status.h"

namespace jax_ep {

struct LowLatencyRdmaOps {
  // Both modules must be built from the same tree: the structs they pass are checked by size.
  uint64_t abi;
  // Each launches one kernel on `stream` and returns nullptr, or an error message (valid until the next call on
  // this thread).
  const char* (*dispatch_send)(const ll::DispatchSendParams& p, cudaStream_t stream);
  const char* (*dispatch_recv)(const ll::DispatchRecvParams& p, cudaStream_t stream);
  const char* (*combine_send)(const ll::CombineSendParams& p, cudaStream_t stream);
  const char* (*combine_recv)(const ll::CombineRecvParams& p, cudaStream_t stream);
};

constexpr uint64_t kLowLatencyRdmaAbi =
    (uint64_t{2} << 48) ^ (sizeof(ll::DispatchSendParams) << 36) ^ (sizeof(ll::DispatchRecvParams) << 24) ^
    (sizeof(ll::CombineSendParams) << 12) ^ sizeof(ll::CombineRecvParams) ^ (sizeof(LowLatencyLayout) << 40);

// The table the LL handlers launch through (cuda/transport/rdma_ops.cc); nullptr clears it. Error: another ABI.
Status set_low_latency_rdma_ops(const LowLatencyRdmaOps* ops);
const LowLatencyRdmaOps* low_latency_rdma_ops();  // nullptr until set

}  // namespace jax_ep
