// The nanobind module jax_ep._jax_ep_native: the one registration point of the native part.
//
// Python (jax_ep/_native.py) registers every entry of registrations() in one loop. Importing this module touches
// no GPU and needs no libcuda (cudart is static and loads the driver at the first CUDA call).
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include <string>
#include <tuple>
#include <vector>

#include "jax_ep/buffer_layout.h"
#include "jax_ep/low_latency.h"
#include "jax_ep/peer_group.h"
#include "registry.h"
#include "xla/ffi/api/c_api.h"

#ifndef JAX_EP_VERSION
#define JAX_EP_VERSION "0.0.0"
#endif

namespace nb = nanobind;

namespace {

struct Target {
  const char* name;
  const char* platform;  // as jax.ffi.register_ffi_target spells it
  XLA_FFI_Handler* handler;
};

const std::vector<Target>& Targets() {
  static const std::vector<Target> targets = {
      {"jax_ep_layout_v1", "cpu", JaxEpLayoutCpuV1},
      {"jax_ep_layout_v1", "CUDA", JaxEpLayoutCudaV1},
      {"jax_ep_dispatch_v1", "CUDA", JaxEpDispatchCudaV1},
      {"jax_ep_cached_dispatch_v1", "CUDA", JaxEpCachedDispatchCudaV1},
      {"jax_ep_combine_v1", "CUDA", JaxEpCombineCudaV1},
      {"jax_ep_ll_dispatch_send_v1", "CUDA", JaxEpLowLatencyDispatchSendCudaV1},
      {"jax_ep_ll_dispatch_recv_v1", "CUDA", JaxEpLowLatencyDispatchRecvCudaV1},
      {"jax_ep_ll_combine_send_v1", "CUDA", JaxEpLowLatencyCombineSendCudaV1},
      {"jax_ep_ll_combine_recv_v1", "CUDA", JaxEpLowLatencyCombineRecvCudaV1},
  };
  return targets;
}

void throw_if_error(const jax_ep::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

}  // namespace

NB_MODULE(_jax_ep_native, m) {
  m.doc() = "jax_ep native part: XLA FFI handlers and CUDA kernels (see docs/API.md)";

  m.def("version", []() { return std::string(JAX_EP_VERSION); }, "jax_ep version this module was built from");
  m.def("ffi_api_version", []() { return std::make_tuple(int{XLA_FFI_API_MAJOR}, int{XLA_FFI_API_MINOR}); },
        "(major, minor) of the XLA FFI headers this module was compiled against; XLA rejects handlers newer than "
        "itself");
  m.def("cuda_runtime_version", []() { return int{CUDART_VERSION}; },
        "CUDART_VERSION the module was compiled with (e.g. 13000); compile-time, needs no GPU");
  m.def(
      "registrations",
      []() {
        std::vector<std::tuple<std::string, std::string, nb::capsule>> out;
        for (const Target& t : Targets())
          out.emplace_back(t.name, t.platform, nb::capsule(reinterpret_cast<void*>(t.handler)));
        return out;
      },
      "list of (target_name, platform, PyCapsule) to pass to jax.ffi.register_ffi_target");

  m.def("normal_buffer_bytes", &jax_ep::normal_buffer_bytes, nb::arg("hidden"), nb::arg("num_topk"),
        nb::arg("max_tokens_per_rank"), nb::arg("num_ranks"), nb::arg("capacity"), nb::arg("num_experts"),
        "staging bytes per rank for a normal-mode config (jax_ep/buffer_layout.py mirrors this formula)");

  m.def("low_latency_buffer_bytes", &jax_ep::low_latency_buffer_bytes, nb::arg("hidden"),
        nb::arg("max_tokens_per_rank"), nb::arg("num_ranks"), nb::arg("num_experts"),
        "bytes of the low-latency region per rank for a config (jax_ep/buffer_layout.py mirrors this formula)");

  // ---- intranode groups (one process, CUDA peer access) ----
  m.def(
      "intranode_create_group",
      [](const std::vector<int>& device_ordinals, int64_t buffer_bytes, int64_t set_id) {
        int64_t id = -1;
        {
          nb::gil_scoped_release release;  // allocation, peer access and a warm-up barrier on every device
          throw_if_error(jax_ep::create_group(device_ordinals, buffer_bytes, set_id, &id));
        }
        return id;
      },
      nb::arg("device_ordinals"), nb::arg("buffer_bytes"), nb::arg("set_id") = -1,
      "Creates a group over CUDA device ordinals (rank order): allocates buffer_bytes of staging per device, enables "
      "peer access between all pairs, runs one warm-up barrier. Returns the group id. set_id: pass the id of an "
      "earlier group so several disjoint groups of one mesh answer one handler attribute (default: own set).");
  m.def(
      "intranode_register_external_group",
      [](int device_ordinal, int rank, const std::vector<uintptr_t>& peer_bases, int64_t buffer_bytes,
         int64_t set_id) {
        int64_t id = -1;
        throw_if_error(jax_ep::register_external_group(device_ordinal, rank, peer_bases, buffer_bytes, set_id, &id));
        return id;
      },
      nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("peer_bases"), nb::arg("buffer_bytes"),
      nb::arg("set_id") = -1,
      "One process per GPU (NVSHMEM): registers this process's rank of a group whose buffers the caller allocated "
      "and mapped (peer_bases[r] = rank r's buffer as this device addresses it, e.g. nvshmem_ptr). The buffer must "
      "be zeroed before the first op; jax_ep never frees it. Returns the group id.");
  m.def(
      "intranode_warmup_group",
      [](int64_t id, uint64_t timeout_ns) {
        nb::gil_scoped_release release;
        throw_if_error(jax_ep::warmup_group(id, timeout_ns));
      },
      nb::arg("id"), nb::arg("timeout_ns") = 30ull * 1000 * 1000 * 1000,
      "Collective: one device-side group barrier on this process's devices of the group, waited for on the host.");
  m.def(
      "intranode_destroy_group",
      [](int64_t id) {
        nb::gil_scoped_release release;
        throw_if_error(jax_ep::destroy_group(id));
      },
      nb::arg("id"), "Waits for the group's devices to go idle and frees its buffers.");
  m.def(
      "intranode_group_info",
      [](int64_t id) {
        jax_ep::GroupInfo info;
        throw_if_error(jax_ep::group_info(id, &info));
        nb::dict d;
        d["id"] = info.id;
        d["set_id"] = info.set_id;
        d["device_ordinals"] = info.device_ordinals;
        d["num_ranks"] = info.device_ordinals.size();
        d["buffer_bytes"] = info.buffer_bytes;
        d["buffers"] = info.buffers;
        d["sm_counts"] = info.sm_counts;
        d["transport"] = info.owns_buffers ? "cuda-peer" : "external";
        return d;
      },
      nb::arg("id"), "What a group holds (ids, devices, bytes, device addresses of the staging buffers).");
}
