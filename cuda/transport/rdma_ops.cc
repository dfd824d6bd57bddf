// The process-wide LowLatencyRdmaOps table (jax_ep/rdma_ops.h): set by the NVSHMEM module through Python at
// initialize, read by the low-latency handlers on every call (an acquire load).
#include "jax_ep/rdma_ops.h"

#include <atomic>
#include <string>

namespace jax_ep {
namespace {
std::atomic<const LowLatencyRdmaOps*> g_ops{nullptr};
}  // namespace

Status set_low_latency_rdma_ops(const LowLatencyRdmaOps* ops) {
  if (ops != nullptr && ops->abi != kLowLatencyRdmaAbi)
    return Status::Error("the NVSHMEM module's low-latency kernels were built from another jax_ep tree (ABI " +
                         std::to_string(ops->abi) + ", expected " + std::to_string(kLowLatencyRdmaAbi) +
                         "): rebuild both modules together");
  g_ops.store(ops, std::memory_order_release);
  return Status::Ok();
}

const LowLatencyRdmaOps* low_latency_rdma_ops() { return g_ops.load(std::memory_order_acquire); }

}  // namespace jax_ep
