// The process-wide LowLatencyRdmaOps and NormalRdmaOps tables (jax_ep/rdma_ops.h): set by the NVSHMEM module through Python at
// initialize, read by the low-latency handlers on every call (an acquire load).
#include "jax_ep/rdma_ops.h"

#include <atomic>
#include <string>

namespace jax_ep {
namespace {
std::atomic<const LowLatencyRdmaOps*> g_ops{nullptr};
std::atomic<const NormalRdmaOps*> g_normal_ops{nullptr};

Status another_tree(const char* what, uint64_t got, uint64_t want) {
  return Status::Error(std::string("the NVSHMEM module's ") + what + " were built from another jax_ep tree (ABI " +
                       std::to_string(got) + ", expected " + std::to_string(want) + "): rebuild both modules together");
}
}  // namespace

Status set_low_latency_rdma_ops(const LowLatencyRdmaOps* ops) {
  if (ops != nullptr && ops->abi != kLowLatencyRdmaAbi)
    return another_tree("low-latency kernels", ops->abi, kLowLatencyRdmaAbi);
  g_ops.store(ops, std::memory_order_release);
  return Status::Ok();
}

const LowLatencyRdmaOps* low_latency_rdma_ops() { return g_ops.load(std::memory_order_acquire); }

Status set_normal_rdma_ops(const NormalRdmaOps* ops) {
  if (ops != nullptr && ops->abi != kNormalRdmaAbi) return another_tree("normal-mode kernels", ops->abi, kNormalRdmaAbi);
  g_normal_ops.store(ops, std::memory_order_release);
  return Status::Ok();
}

const NormalRdmaOps* normal_rdma_ops() { return g_normal_ops.load(std::memory_order_acquire); }

}  // namespace jax_ep
