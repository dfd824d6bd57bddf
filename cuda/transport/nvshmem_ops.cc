// The process-wide LowLatencyNvshmemOps and NormalNvshmemOps tables (jax_ep/nvshmem_ops.h): set by the NVSHMEM module through Python at
// initialize, read by the low-latency handlers on every call (an acquire load).
#include "jax_ep/nvshmem_ops.h"

#include <atomic>
#include <string>

namespace jax_ep {
namespace {
std::atomic<const LowLatencyNvshmemOps*> g_ops{nullptr};
std::atomic<const NormalNvshmemOps*> g_normal_ops{nullptr};

Status another_tree(const char* what, uint64_t got, uint64_t want) {
  return Status::Error(std::string("the NVSHMEM module's ") + what + " were built from another jax_ep tree (ABI " +
                       std::to_string(got) + ", expected " + std::to_string(want) + "): rebuild both modules together");
}
}  // namespace

Status set_low_latency_nvshmem_ops(const LowLatencyNvshmemOps* ops) {
  if (ops != nullptr && ops->abi != kLowLatencyNvshmemAbi)
    return another_tree("low-latency kernels", ops->abi, kLowLatencyNvshmemAbi);
  g_ops.store(ops, std::memory_order_release);
  return Status::Ok();
}

const LowLatencyNvshmemOps* low_latency_nvshmem_ops() { return g_ops.load(std::memory_order_acquire); }

Status set_normal_nvshmem_ops(const NormalNvshmemOps* ops) {
  if (ops != nullptr && ops->abi != kNormalNvshmemAbi) return another_tree("normal-mode kernels", ops->abi, kNormalNvshmemAbi);
  g_normal_ops.store(ops, std::memory_order_release);
  return Status::Ok();
}

const NormalNvshmemOps* normal_nvshmem_ops() { return g_normal_ops.load(std::memory_order_acquire); }

}  // namespace jax_ep
