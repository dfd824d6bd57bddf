// The low-latency kernels that move rows with NVSHMEM puts (EPConfig.allow_nvlink_for_low_latency=False; the RDMA
// leg of docs/INTERNODE.md) live in jax_ep._jax_ep_nvshmem, the one binary linked with NVSHMEM's device library
// (nvshmem/device/low_latency.cu). The FFI handlers live in jax_ep._jax_ep_native. This table joins them: the NVSHMEM
// module hands its address to the native module at initialize (runtime/nvshmem.py -> set_low_latency_nvshmem_ops), and
// the LL handlers launch through it, with the same parameter structs as the NVLink kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jax_ep/low_latency_params.h"
#include "jax_ep/normal_params.h"
#include "jax_ep/status.h"

namespace jax_ep {

struct LowLatencyNvshmemOps {
  // Both modules must be built from the same tree: the structs they pass are checked by size.
  uint64_t abi;
  // Each launches one kernel on `stream` and returns nullptr, or an error message (valid until the next call on
  // this thread).
  const char* (*dispatch_send)(const low_latency::DispatchSendParams& p, cudaStream_t stream);
  const char* (*dispatch_recv)(const low_latency::DispatchRecvParams& p, cudaStream_t stream);
  const char* (*combine_send)(const low_latency::CombineSendParams& p, cudaStream_t stream);
  const char* (*combine_recv)(const low_latency::CombineRecvParams& p, cudaStream_t stream);
};

constexpr uint64_t kLowLatencyNvshmemAbi =
    (uint64_t{2} << 48) ^ (sizeof(low_latency::DispatchSendParams) << 36) ^ (sizeof(low_latency::DispatchRecvParams) << 24) ^
    (sizeof(low_latency::CombineSendParams) << 12) ^ sizeof(low_latency::CombineRecvParams) ^ (sizeof(LowLatencyLayout) << 40);

// The table the LL handlers launch through (cuda/transport/nvshmem_ops.cc); nullptr clears it. Error: another ABI.
Status set_low_latency_nvshmem_ops(const LowLatencyNvshmemOps* ops);
const LowLatencyNvshmemOps* low_latency_nvshmem_ops();  // nullptr until set

// The normal-mode kernels over NVSHMEM (EPConfig.normal_over_nvshmem: a group wider than one NVLink domain;
// nvshmem/device/normal_send.cu), launched by cuda/kernels/normal_kernels.cu for a group with GroupCtx::remote != 0
// in place of its own barrier / notify / send / wait kernels. The copy-out and the combine reduction are the NVLink
// path's (same staging layout).
struct NormalNvshmemOps {
  uint64_t abi;
  const char* (*barrier)(const GroupCtx& g, cudaStream_t stream);
  const char* (*dispatch_notify)(const normal::DispatchParams& p, cudaStream_t stream);
  // Dispatch and cached dispatch: sends this rank's rows and waits (hierarchical: forwards, then waits) until every
  // row of the op is in this rank's staging; the copy-out follows in stream order.
  const char* (*send_and_receive_rows)(const normal::SendArgs& a, int blocks, cudaStream_t stream);
  // Combine: sends this rank's received rows back (node-first with forwarding: summed per node by the forwarders)
  // and waits until every row or node partial of this rank's tokens is in its staging; the reduction follows.
  const char* (*combine_send_and_receive)(const normal::CombineParams& p, int blocks, cudaStream_t stream);
};

// Sizes catch most changes of the shared structs; the leading tag goes up whenever a field moves within one.
constexpr uint64_t kNormalNvshmemAbi =
    (uint64_t{4} << 48) ^ (sizeof(normal::DispatchParams) << 36) ^ (sizeof(normal::SendArgs) << 24) ^
    (sizeof(normal::CombineParams) << 12) ^ sizeof(GroupCtx) ^ (sizeof(BufferLayout) << 40);

Status set_normal_nvshmem_ops(const NormalNvshmemOps* ops);
const NormalNvshmemOps* normal_nvshmem_ops();  // nullptr until set

}  // namespace jax_ep
