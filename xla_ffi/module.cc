// The nanobind module jax_ep._jax_ep_native: the one registration point of the native part (native_interface.md §1).
//
// Python registers every entry of state_types() (jax.ffi.register_ffi_type, before any target), then every entry of
// registrations() (jax.ffi.register_ffi_target) in one loop. Importing this module touches no GPU and needs no
// libcuda (cudart is static and loads the driver at the first CUDA call); nothing below except group_* calls CUDA.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "jax_ep/api.h"
#include "jax_ep/peer_group.h"
#include "jax_ep/nvshmem_ops.h"
#include "jax_ep/staging_layout.h"
#include "direct_buffers.h"
#include "receive_pools.h"
#include "op_state.h"
#include "registry.h"
#include "test_hooks.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#ifndef JAX_EP_VERSION
#define JAX_EP_VERSION "0.0.0"
#endif

static_assert(XLA_FFI_API_MAJOR > 0 || XLA_FFI_API_MINOR >= 2,
              "jax_ep needs XLA FFI headers >= 0.2 (jaxlib >= 0.10.2): MakeTypeInfo, State<T>");

namespace nb = nanobind;

namespace {

constexpr const char* kStateTypeName = "jax_ep_op_state_v2";

// A target: stateless (execute only) or a stateful bundle (instantiate != nullptr, state type OpState). `op` is the
// name Python asks for (target_names()); `name` the versioned FFI target from registry.h.
struct Target {
  const char* op;
  const char* name;
  const char* platform;  // as jax.ffi.register_ffi_target spells it
  XLA_FFI_Handler* instantiate;
  XLA_FFI_Handler* execute;
};

const std::vector<Target>& Targets() {
  namespace t = jax_ep::targets;
  static const std::vector<Target> targets = {
      {"layout", t::kLayout, "cpu", nullptr, JaxEpLayoutCpuV1},
      {"layout", t::kLayout, "CUDA", nullptr, JaxEpLayoutCudaV1},
      {"dispatch", t::kDispatch, "CUDA", JaxEpDispatchInstantiateV4, JaxEpDispatchCudaV4},
      {"cached_dispatch", t::kCachedDispatch, "CUDA", JaxEpCachedDispatchInstantiateV4, JaxEpCachedDispatchCudaV4},
      {"combine", t::kCombine, "CUDA", JaxEpCombineInstantiateV4, JaxEpCombineCudaV4},
      {"low_latency_dispatch", t::kLowLatencyDispatch, "CUDA", JaxEpLowLatencyDispatchInstantiateV6,
       JaxEpLowLatencyDispatchCudaV6},
      {"low_latency_dispatch_send", t::kLowLatencyDispatchSend, "CUDA", JaxEpLowLatencyDispatchSendInstantiateV6,
       JaxEpLowLatencyDispatchSendCudaV6},
      {"low_latency_dispatch_recv", t::kLowLatencyDispatchRecv, "CUDA", JaxEpLowLatencyDispatchRecvInstantiateV6,
       JaxEpLowLatencyDispatchRecvCudaV6},
      {"low_latency_combine", t::kLowLatencyCombine, "CUDA", JaxEpLowLatencyCombineInstantiateV6,
       JaxEpLowLatencyCombineCudaV6},
      {"low_latency_combine_send", t::kLowLatencyCombineSend, "CUDA", JaxEpLowLatencyCombineSendInstantiateV6,
       JaxEpLowLatencyCombineSendCudaV6},
      {"low_latency_combine_recv", t::kLowLatencyCombineRecv, "CUDA", JaxEpLowLatencyCombineRecvInstantiateV6,
       JaxEpLowLatencyCombineRecvCudaV6},
  };
  return targets;
}

nb::capsule handler_capsule(XLA_FFI_Handler* h) { return nb::capsule(reinterpret_cast<void*>(h)); }

void throw_if_error(const jax_ep::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

void require_positive(const char* fn, const char* name, int64_t v) {
  if (v <= 0) throw nb::value_error((std::string(fn) + ": " + name + " must be positive, got " + std::to_string(v)).c_str());
}

void require_non_negative(const char* fn, const char* what, const std::vector<int64_t>& v) {
  for (size_t i = 0; i < v.size(); ++i)
    if (v[i] < 0)
      throw nb::value_error((std::string(fn) + ": " + what + "[" + std::to_string(i) + "] must be >= 0, got " +
                             std::to_string(v[i]))
                                .c_str());
}

void def_staging(nb::module_& m) {
  m.def(
      "normal_buffer_bytes",
      [](int64_t hidden, int64_t num_topk, int64_t max_tokens_per_rank, int64_t num_ranks, int64_t capacity,
         int64_t num_experts, bool nvshmem, int64_t nvl_domain) {
        const char* fn = "normal_buffer_bytes";
        require_positive(fn, "hidden", hidden);
        require_positive(fn, "num_topk", num_topk);
        require_positive(fn, "max_tokens_per_rank", max_tokens_per_rank);
        require_positive(fn, "num_ranks", num_ranks);
        require_positive(fn, "capacity", capacity);
        require_positive(fn, "num_experts", num_experts);
        if (nvl_domain < 0) throw nb::value_error("normal_buffer_bytes: nvl_domain must be >= 0");
        return jax_ep::normal_buffer_bytes(hidden, num_topk, max_tokens_per_rank, num_ranks, capacity, num_experts,
                                           nvshmem, nvl_domain);
      },
      nb::arg("hidden"), nb::arg("num_topk"), nb::arg("max_tokens_per_rank"), nb::arg("num_ranks"),
      nb::arg("capacity"), nb::arg("num_experts"), nb::arg("nvshmem") = false, nb::arg("nvl_domain") = 0,
      "Bytes of the normal-mode region one rank needs for a config (signal header included); nvshmem: with the send "
      "area of the NVSHMEM normal-mode kernels (EPConfig.normal_over_nvshmem); nvl_domain (num_max_nvl_peers, with "
      "nvshmem): with the forwarding areas of hierarchical dispatch (nodes of 2 to 8 ranks, at least 2 nodes).");
  m.def(
      "low_latency_buffer_bytes",
      [](int64_t hidden, int64_t max_tokens_per_rank, int64_t num_ranks, int64_t num_experts, bool staged) {
        const char* fn = "low_latency_buffer_bytes";
        require_positive(fn, "hidden", hidden);
        require_positive(fn, "max_tokens_per_rank", max_tokens_per_rank);
        require_positive(fn, "num_ranks", num_ranks);
        require_positive(fn, "num_experts", num_experts);
        return jax_ep::low_latency_buffer_bytes(hidden, max_tokens_per_rank, num_ranks, num_experts, staged);
      },
      nb::arg("hidden"), nb::arg("max_tokens_per_rank"), nb::arg("num_ranks"), nb::arg("num_experts"),
      nb::arg("staged") = false,
      "Bytes of the low-latency region one rank needs for a config (scratch, RDMA words, two halves); staged: the "
      "config sends through NVSHMEM puts (EPConfig.allow_nvlink_for_low_latency=False) and needs send slots too.");
  m.def(
      "staging_plan",
      [](const std::vector<int64_t>& normal, const std::vector<int64_t>& low_latency) {
        require_non_negative("staging_plan", "normal", normal);
        require_non_negative("staging_plan", "low_latency", low_latency);
        const jax_ep::StagingPlan p =
            jax_ep::make_staging_plan(normal.data(), normal.size(), low_latency.data(), low_latency.size());
        return std::make_tuple(p.buffer_bytes, p.low_latency_offset, p.low_latency_bytes);
      },
      nb::arg("normal"), nb::arg("low_latency"),
      "(buffer_bytes, low_latency_offset, low_latency_bytes) of one device's staging: [normal region = max(normal) | LL region = "
      "max(low_latency)]; low_latency_offset = the aligned end of the normal region (>= the signal header), low_latency_bytes = 0 "
      "when low_latency is empty.");
}

void def_groups(nb::module_& m) {
  m.def(
      "group_create",
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
      "earlier group so several disjoint groups of one mesh serve one bound axis (default: own set).");
  m.def(
      "group_register_external",
      [](int device_ordinal, int rank, const std::vector<uintptr_t>& peer_bases, int64_t buffer_bytes,
         int64_t set_id, const std::vector<int>& pes) {
        int64_t id = -1;
        throw_if_error(
            jax_ep::register_external_group(device_ordinal, rank, peer_bases, buffer_bytes, set_id, &id, pes));
        return id;
      },
      nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("peer_bases"), nb::arg("buffer_bytes"),
      nb::arg("set_id") = -1, nb::arg("pes") = std::vector<int>{},
      "One process per GPU (NVSHMEM): registers this process's rank of a group whose buffers the caller allocated "
      "and mapped (peer_bases[r] = rank r's buffer as this device addresses it, e.g. nvshmem_ptr). The buffer must "
      "be zeroed before the first op; jax_ep never frees it. Returns the group id.");
  m.def(
      "group_set_receive_pool",
      [](int64_t id, uintptr_t begin, int64_t bytes, const std::vector<int64_t>& delta) {
        throw_if_error(jax_ep::set_receive_pool(id, begin, bytes, delta));
      },
      nb::arg("id"), nb::arg("begin"), nb::arg("bytes"), nb::arg("delta"),
      "One process per GPU: this rank's receive pool [begin, begin + bytes) and delta[d] = where rank d addresses a "
      "byte of it minus where this rank does. Every rank of the group registers one or none (receive_pools.py).");
  m.def(
      "receive_pool_export",
      [](uintptr_t ptr) {
        jax_ep::receive_pools::Exported e;
        throw_if_error(jax_ep::receive_pools::export_pool(ptr, &e));
        return nb::make_tuple(e.fd, e.base, e.bytes);
      },
      nb::arg("ptr"),
      "(fd, base, bytes): the allocation of the virtual-memory mapping holding device pointer ptr (XLA's pool) "
      "exported as a POSIX file descriptor (the caller closes it), and the mapping's range.");
  m.def(
      "receive_pool_import",
      [](int fd, int64_t pid, uintptr_t base, int64_t bytes, int ordinal, int64_t probe_offset, nb::bytes expect) {
        uintptr_t local = 0;
        const std::string want(expect.c_str(), expect.size());
        {
          nb::gil_scoped_release release;
          throw_if_error(
              jax_ep::receive_pools::import_pool(fd, pid, base, bytes, ordinal, probe_offset, want, &local));
        }
        return local;
      },
      nb::arg("fd"), nb::arg("pid"), nb::arg("base"), nb::arg("bytes"), nb::arg("ordinal"), nb::arg("probe_offset"),
      nb::arg("expect"),
      "Maps another process's exported pool (receive_pool_export there) for CUDA device `ordinal` of this process, "
      "checks that `expect` lies at probe_offset, and returns where this process addresses the pool's first byte.");
  m.def(
      "group_warmup",
      [](int64_t id, uint64_t timeout_ns) {
        nb::gil_scoped_release release;
        throw_if_error(jax_ep::warmup_group(id, timeout_ns));
      },
      nb::arg("id"), nb::arg("timeout_ns") = 30ull * 1000 * 1000 * 1000,
      "Collective: one device-side group barrier on this process's devices of the group, waited for on the host.");
  m.def(
      "group_destroy",
      [](int64_t id) {
        nb::gil_scoped_release release;
        throw_if_error(jax_ep::destroy_group(id));
      },
      nb::arg("id"), "Waits for the group's devices to go idle and frees its buffers (owned groups).");
  m.def(
      "group_info",
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

// The ops table inside a capsule of jax_ep._jax_ep_nvshmem.<source>(), or nullptr for None.
template <typename Table>
const Table* table_from_capsule(nb::object ops, const char* fn, const char* name, const char* source) {
  if (ops.is_none()) return nullptr;
  nb::capsule cap = nb::cast<nb::capsule>(ops);
  if (cap.name() == nullptr || std::string(cap.name()) != name)
    throw std::invalid_argument(std::string(fn) + ": expected the capsule of jax_ep._jax_ep_nvshmem." + source + "()");
  return static_cast<const Table*>(cap.data());
}

void def_bindings(nb::module_& m) {
  m.def(
      "set_low_latency_nvshmem_ops",
      [](nb::object ops) {
        throw_if_error(jax_ep::set_low_latency_nvshmem_ops(table_from_capsule<jax_ep::LowLatencyNvshmemOps>(
            ops, "set_low_latency_nvshmem_ops", "jax_ep.LowLatencyNvshmemOps", "low_latency_nvshmem_ops")));
      },
      nb::arg("ops").none(),
      "Installs the NVSHMEM module's low-latency kernels (EPConfig.low_latency_over_nvshmem), or clears them with "
      "None. The table must come from a module built from the same tree (checked).");
  m.def("has_low_latency_nvshmem_ops", []() { return jax_ep::low_latency_nvshmem_ops() != nullptr; });
  m.def(
      "set_normal_nvshmem_ops",
      [](nb::object ops) {
        throw_if_error(jax_ep::set_normal_nvshmem_ops(table_from_capsule<jax_ep::NormalNvshmemOps>(
            ops, "set_normal_nvshmem_ops", "jax_ep.NormalNvshmemOps", "normal_nvshmem_ops")));
      },
      nb::arg("ops").none(),
      "Installs the NVSHMEM module's normal-mode kernels (EPConfig.normal_over_nvshmem), or clears them with None. "
      "The table must come from a module built from the same tree (checked).");
  m.def("has_normal_nvshmem_ops", []() { return jax_ep::normal_nvshmem_ops() != nullptr; });
  m.def(
      "bind_axis",
      [](const std::string& axis, int64_t set_id, int64_t low_latency_offset, int64_t low_latency_bytes) {
        jax_ep::AxisBinding b;
        b.set_id = set_id;
        b.low_latency_offset = low_latency_offset;
        b.low_latency_bytes = low_latency_bytes;
        const jax_ep::Status st = jax_ep::bind_axis(axis, b);
        if (!st.ok()) throw nb::value_error(st.message().c_str());
      },
      nb::arg("axis"), nb::arg("set_id"), nb::arg("low_latency_offset"), nb::arg("low_latency_bytes"),
      "From now on a call site whose `axis` attribute is `axis` and that has not run yet uses the group of set "
      "`set_id` that holds its device, and the low-latency region (low_latency_offset, low_latency_bytes) of that group's staging "
      "(call sites that ran keep their group while it exists). Rebinding replaces. No CUDA call.");
  m.def(
      "unbind_axis", [](const std::string& axis) { jax_ep::unbind_axis(axis); }, nb::arg("axis"),
      "Removes the binding of `axis` (no error if unbound).");
  m.def(
      "bound_axes",
      []() {
        nb::dict out;
        for (const auto& [axis, b] : jax_ep::bound_axes()) {
          nb::dict d;
          d["set_id"] = b.set_id;
          d["low_latency_offset"] = b.low_latency_offset;
          d["low_latency_bytes"] = b.low_latency_bytes;
          out[nb::str(axis.c_str())] = d;
        }
        return out;
      },
      "{axis: {set_id, low_latency_offset, low_latency_bytes}} of every bound axis (diagnostics).");
}

}  // namespace

NB_MODULE(_jax_ep_native, m) {
  m.doc() = "jax_ep native part: XLA FFI handlers and CUDA kernels (see docs/API.md)";

  m.def("launching_handler_calls", []() { return jax_ep::test_hooks::launching_calls().load(); },
        "Calls of jax_ep's kernel-launching FFI handlers in this process, every device: a count that stops growing "
        "while steps run means XLA replays them from a command buffer (CUDA graph).");
  m.def("direct_buffer_calls", []() { return jax_ep::direct_buffers::calls(); },
        "Normal-mode calls in this process (every device) that used direct buffers: dispatch whose senders wrote "
        "straight into the receiving rank's outputs, combine that read the peers' rows (no staging).");
  m.def("direct_buffers_enabled", []() { return jax_ep::direct_buffers::enabled(); },
        "Whether direct buffers are on for later dispatch calls of this process.");
  m.def("set_direct_buffers", [](bool on) { jax_ep::direct_buffers::set_enabled(on); }, nb::arg("on"),
        "Turns direct buffers on or off for later dispatch calls of this process (default on; "
        "JAX_EP_DIRECT_BUFFERS=0 starts it off). A call recorded in a command buffer keeps what it was recorded with.");
  m.def("pull_combine_min_bytes", []() { return jax_ep::direct_buffers::pull_combine_min_bytes(); },
        "The smallest normal-mode combine output (bytes) that pulls the peers' rows when direct buffers are on.");
  m.def(
      "set_pull_combine_min_bytes",
      [](int64_t bytes) {
        if (bytes < 0) throw nb::value_error("set_pull_combine_min_bytes: bytes must be 0 or more");
        jax_ep::direct_buffers::set_pull_combine_min_bytes(bytes);
      },
      nb::arg("bytes"),
      "Sets it for later combine calls of this process (default 2**50: none pulls, or JAX_EP_PULL_COMBINE_MIN_BYTES; 0: every "
      "combine whose buffers allow it pulls). A call recorded in a command buffer keeps what it was recorded with.");
  m.def(
      "pointer_facts",
      [](uintptr_t ptr) {
        const jax_ep::direct_buffers::PointerFacts f =
            jax_ep::direct_buffers::describe(reinterpret_cast<const void*>(ptr));
        nb::dict d;
        d["query_result"] = f.query_result;
        d["legacy_ipc"] = f.legacy_ipc;
        d["from_pool"] = f.from_pool;
        d["range_start"] = f.range_start;
        d["range_size"] = f.range_size;
        d["device"] = f.device;
        nb::list access;
        for (int a : f.access) access.append(a);
        d["access"] = access;
        return d;
      },
      nb::arg("ptr"),
      "What the CUDA driver says of the allocation holding a device pointer (e.g. a jax.Array's "
      "unsafe_buffer_pointer()): direct buffers can use a cudaMalloc allocation (legacy_ipc 1) or a virtual-memory "
      "mapping every device of the group may read and write (access 3 for each); never a pool (from_pool).");
  m.def(
      "test_phases",
      [](bool reset) {
        std::vector<std::string> names;
        std::vector<uint64_t> ns, hits;
        jax_ep::Status st;
        {
          nb::gil_scoped_release release;
          st = jax_ep::normal::phases(reset, &names, &ns, &hits);
          std::vector<std::string> ll_names;
          std::vector<uint64_t> ll_ns, ll_hits;
          if (st.ok()) st = jax_ep::low_latency::phases(reset, &ll_names, &ll_ns, &ll_hits);
          names.insert(names.end(), ll_names.begin(), ll_names.end());
          ns.insert(ns.end(), ll_ns.begin(), ll_ns.end());
          hits.insert(hits.end(), ll_hits.begin(), ll_hits.end());
        }
        if (!st.ok()) throw std::runtime_error(st.message());
        nb::list out;
        for (size_t i = 0; i < names.size(); ++i) out.append(nb::make_tuple(names[i], ns[i], hits[i]));
        return out;
      },
      nb::arg("reset") = false,
      "Test hook: [(phase, summed ns from a block's start, stamps)] of the NVLink kernels (normal mode, then low "
      "latency) since the last reset, over this process's devices; stamped only when JAX_EP_TEST_PHASES=1 was set "
      "before initialize (cuda/common/phase_stamps.cuh).");
  m.def("version", []() { return std::string(JAX_EP_VERSION); }, "jax_ep version this module was built from");
  m.def("ffi_api_version", []() { return std::make_tuple(int{XLA_FFI_API_MAJOR}, int{XLA_FFI_API_MINOR}); },
        "(major, minor) of the XLA FFI headers this module was compiled against; XLA rejects handlers newer than "
        "itself");
  m.def("cuda_runtime_version", []() { return int{CUDART_VERSION}; },
        "CUDART_VERSION the module was compiled with (e.g. 13000); compile-time, needs no GPU");
  m.def(
      "device_memory_info",
      [](int ordinal) {
        // cudaMemGetInfo sees every allocation on the device (jax_ep's cudaMalloc'd staging, XLA's pool, NVSHMEM):
        // what a leak check of initialize / finalize needs. Restores the calling thread's device.
        int previous = -1;
        size_t free_bytes = 0, total_bytes = 0;
        jax_ep::Status st = jax_ep::CudaStatus(cudaGetDevice(&previous), "cudaGetDevice", __FILE__, __LINE__);
        if (st.ok()) st = jax_ep::CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice", __FILE__, __LINE__);
        if (st.ok())
          st = jax_ep::CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo", __FILE__, __LINE__);
        if (previous >= 0) cudaSetDevice(previous);
        throw_if_error(st);
        return std::make_tuple(static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes));
      },
      nb::arg("ordinal"), "(free, total) bytes of CUDA device `ordinal` (cudaMemGetInfo); needs a GPU");
  m.def(
      "registrations",
      []() {
        nb::list out;
        for (const Target& t : Targets()) {
          nb::object handler;
          if (t.instantiate != nullptr) {
            nb::dict bundle;
            bundle["instantiate"] = handler_capsule(t.instantiate);
            bundle["execute"] = handler_capsule(t.execute);
            handler = bundle;
          } else {
            handler = handler_capsule(t.execute);
          }
          out.append(nb::make_tuple(t.name, t.platform, handler));
        }
        return out;
      },
      "list of (target_name, platform, handler) for jax.ffi.register_ffi_target: handler is a PyCapsule (stateless) "
      "or a dict {'instantiate', 'execute'} of PyCapsules (stateful; register state_types() first)");
  m.def(
      "target_names",
      []() {
        nb::dict out;
        for (const Target& t : Targets()) out[t.op] = t.name;
        return out;
      },
      "dict op -> versioned FFI target name (e.g. 'low_latency_dispatch' -> 'jax_ep_low_latency_dispatch_v6'): the one "
      "list jax_ep.backends._ffi and jax.export users read");
  m.def(
      "state_types",
      []() {
        static XLA_FFI_TypeInfo type_info = ::xla::ffi::MakeTypeInfo<jax_ep::OpState>();
        nb::dict reg;
        reg["type_id"] = nb::capsule(reinterpret_cast<void*>(&jax_ep::OpState::id));
        reg["type_info"] = nb::capsule(reinterpret_cast<void*>(&type_info));
        nb::list out;
        out.append(nb::make_tuple(kStateTypeName, reg));
        return out;
      },
      "list of (type_name, {'type_id', 'type_info'}) for jax.ffi.register_ffi_type(name, reg, platform='CUDA'), "
      "to be registered before any target");

  def_staging(m);
  def_groups(m);
  def_bindings(m);
}
