// Transport host side: the group registry (create / register / warm up / destroy) and the axis bindings that
// handlers resolve through (jax_ep/peer_group.h).
#include "jax_ep/peer_group.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "jax_ep/api.h"
#include "jax_ep/constants.h"
#include "jax_ep/device_restorer.h"
#include "jax_ep/signal_header.h"
#include "jax_ep/staging_layout.h"

namespace jax_ep {
namespace {

struct Group {
  GroupInfo info;
  std::vector<char*> buffers;
  // Cleared (under the exclusive lock) by destroy_group before the buffers go; handlers keep a resolution of this
  // group exactly while it is set (xla_ffi/op_state.h, "pinning").
  std::shared_ptr<std::atomic<bool>> alive = std::make_shared<std::atomic<bool>>(true);
};

// One lock guards the groups, the bindings and the generation bumps; handlers take it shared, and only on a miss
// of their per-device cache.
std::shared_mutex& registry_mutex() {
  static std::shared_mutex m;
  return m;
}
std::map<int64_t, std::unique_ptr<Group>>& registry() {
  static std::map<int64_t, std::unique_ptr<Group>> r;
  return r;
}
std::map<std::string, AxisBinding>& bindings() {
  static std::map<std::string, AxisBinding> b;
  return b;
}
int64_t next_id = 1;

// NOTE: bumped (under the exclusive lock) by every change of groups or bindings. A handler's cached resolution is
// valid while the generation it was made under is current; the counter starts at 1 so 0 means "nothing cached".
std::atomic<uint64_t> generation{1};
void bump_generation() { generation.fetch_add(1, std::memory_order_acq_rel); }

Status free_buffers(const std::vector<int>& ordinals, std::vector<char*>& buffers) {
  Status first;
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i] == nullptr) continue;
    Status st = CudaStatus(cudaSetDevice(ordinals[i]), "cudaSetDevice", __FILE__, __LINE__);
    if (st.ok()) st = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
    if (st.ok()) st = CudaStatus(cudaFree(buffers[i]), "cudaFree", __FILE__, __LINE__);
    if (!st.ok() && first.ok()) first = st;
    buffers[i] = nullptr;
  }
  return first;
}

Status setup(const std::vector<int>& ordinals, int64_t bytes, Group* g) {
  const int n = static_cast<int>(ordinals.size());
  // Peer access between every pair (already enabled, e.g. by XLA, is fine).
  for (int i = 0; i < n; ++i) {
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinals[i]));
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      JAX_EP_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, ordinals[i], ordinals[j]));
      if (!can)
        return Status::Error("device " + std::to_string(ordinals[i]) + " cannot access device " +
                             std::to_string(ordinals[j]) + " as a peer (no NVLink/P2P path): the in-process "
                             "transport needs peer access between all GPUs of a group");
      const cudaError_t e = cudaDeviceEnablePeerAccess(ordinals[j], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // clear the non-sticky error
      } else {
        JAX_EP_CUDA_RETURN_IF_ERROR(e);
      }
    }
  }
  g->buffers.assign(n, nullptr);
  g->info.sm_counts.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinals[i]));
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&g->buffers[i]), static_cast<size_t>(bytes)));
    // NOTE: zeroed once here; afterwards the counters only grow and the data regions are always written before
    // they are read, so no call ever resets anything from the host.
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaMemset(g->buffers[i], 0, static_cast<size_t>(bytes)));
    JAX_EP_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&g->info.sm_counts[i], cudaDevAttrMultiProcessorCount, ordinals[i]));
  }
  for (int i = 0; i < n; ++i) {
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinals[i]));
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  }
  return Status::Ok();
}

// Adds a set-up group to the registry (id, set id); refuses a device that is already in a group of the same set.
// On refusal an owned group's buffers are freed.
Status insert_group(std::unique_ptr<Group> g, int64_t set_id, int64_t* id_out) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  g->info.id = next_id++;
  g->info.set_id = set_id >= 0 ? set_id : g->info.id;
  g->info.buffers.clear();
  for (char* b : g->buffers) g->info.buffers.push_back(reinterpret_cast<uintptr_t>(b));
  // Two groups of one set must not share a device (a handler could not tell which one it is in).
  for (auto& [other_id, other] : registry()) {
    if (other->info.set_id != g->info.set_id) continue;
    for (int o : other->info.device_ordinals) {
      if (o < 0) continue;
      const auto& mine = g->info.device_ordinals;
      if (std::find(mine.begin(), mine.end(), o) == mine.end()) continue;
      lock.unlock();
      if (g->info.owns_buffers) {
        DeviceRestorer restore;
        free_buffers(g->info.device_ordinals, g->buffers);
      }
      return Status::Error("device " + std::to_string(o) + " is already in group " + std::to_string(other_id) +
                           " of set " + std::to_string(g->info.set_id));
    }
  }
  *id_out = g->info.id;
  registry()[g->info.id] = std::move(g);
  bump_generation();
  return Status::Ok();
}

}  // namespace

Status create_group(const std::vector<int>& device_ordinals, int64_t buffer_bytes, int64_t set_id, int64_t* id_out) {
  const int n = static_cast<int>(device_ordinals.size());
  if (n < 1 || n > kMaxGroupRanks)
    return Status::Error("a group needs 1.." + std::to_string(kMaxGroupRanks) + " devices, got " + std::to_string(n));
  int count = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  for (int i = 0; i < n; ++i) {
    if (device_ordinals[i] < 0 || device_ordinals[i] >= count)
      return Status::Error("device ordinal " + std::to_string(device_ordinals[i]) + " out of range (" +
                           std::to_string(count) + " CUDA devices visible)");
    for (int j = 0; j < i; ++j)
      if (device_ordinals[i] == device_ordinals[j])
        return Status::Error("device ordinal " + std::to_string(device_ordinals[i]) + " listed twice");
  }
  if (buffer_bytes < kSignalHeaderBytes)
    return Status::Error("buffer_bytes must be >= " + std::to_string(kSignalHeaderBytes));
  buffer_bytes = align_up(buffer_bytes);

  auto g = std::make_unique<Group>();
  g->info.device_ordinals = device_ordinals;
  g->info.buffer_bytes = buffer_bytes;
  Status st;
  {
    DeviceRestorer restore;
    st = setup(device_ordinals, buffer_bytes, g.get());
    if (!st.ok()) {
      free_buffers(device_ordinals, g->buffers);
      return Status::Error("group_create failed: " + st.message());
    }
  }
  st = insert_group(std::move(g), set_id, id_out);
  if (!st.ok()) return st;
  // One warm-up barrier on all devices at once (each waits for the others): peer mappings and kernels are loaded
  // before the first op.
  st = warmup_group(*id_out, 30ull * 1000 * 1000 * 1000);
  if (!st.ok()) {
    destroy_group(*id_out);
    return Status::Error("group_create warm-up failed: " + st.message());
  }
  return Status::Ok();
}

Status destroy_group(int64_t id) {
  std::unique_ptr<Group> g;
  {
    std::unique_lock<std::shared_mutex> lock(registry_mutex());
    auto it = registry().find(id);
    if (it == registry().end()) return Status::Error("no group with id " + std::to_string(id));
    g = std::move(it->second);
    registry().erase(it);
    bump_generation();
    g->alive->store(false, std::memory_order_release);  // no handler may use a cached view of this group any more
  }
  if (!g->info.owns_buffers) return Status::Ok();
  DeviceRestorer restore;
  return free_buffers(g->info.device_ordinals, g->buffers);
}

Status register_external_group(int device_ordinal, int rank, const std::vector<uintptr_t>& peer_bases,
                               int64_t buffer_bytes, int64_t set_id, int64_t* id_out, const std::vector<int>& pes) {
  const int n = static_cast<int>(peer_bases.size());
  if (n < 1 || n > kMaxGroupRanks)
    return Status::Error("a group needs 1.." + std::to_string(kMaxGroupRanks) + " ranks, got " + std::to_string(n));
  if (rank < 0 || rank >= n)
    return Status::Error("rank " + std::to_string(rank) + " out of range for a group of " + std::to_string(n));
  // A null base is a rank without a load/store mapping (another host): allowed for NVSHMEM groups (pes given),
  // whose low-latency kernels reach such ranks by NVSHMEM puts; the handlers refuse the kernels that need a pointer
  // (normal mode, the NVLink low-latency kernels) for such a group (OpState::validate).
  for (int r = 0; r < n; ++r) {
    if (peer_bases[r] == 0 && r != rank && !pes.empty()) continue;
    if (peer_bases[r] == 0 || peer_bases[r] % kAlign != 0)
      return Status::Error("peer_bases[" + std::to_string(r) + "] is null or not " + std::to_string(kAlign) +
                           "-byte aligned (no load/store mapping of that peer's buffer: is it NVLink-reachable? "
                           "Only NVSHMEM groups, with pes, may leave other ranks null)");
  }
  if (buffer_bytes < kSignalHeaderBytes)
    return Status::Error("buffer_bytes must be >= " + std::to_string(kSignalHeaderBytes));
  if (!pes.empty() && static_cast<int>(pes.size()) != n)
    return Status::Error("pes must name one NVSHMEM PE per rank (" + std::to_string(n) + "), got " +
                         std::to_string(pes.size()));
  for (int p : pes)
    if (p < 0) return Status::Error("pes must be >= 0, got " + std::to_string(p));
  int count = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device_ordinal < 0 || device_ordinal >= count)
    return Status::Error("device ordinal " + std::to_string(device_ordinal) + " out of range (" +
                         std::to_string(count) + " CUDA devices visible)");
  auto g = std::make_unique<Group>();
  g->info.owns_buffers = false;
  g->info.device_ordinals.assign(n, -1);
  g->info.device_ordinals[rank] = device_ordinal;
  g->info.buffer_bytes = buffer_bytes;
  g->info.sm_counts.assign(n, 0);
  JAX_EP_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&g->info.sm_counts[rank], cudaDevAttrMultiProcessorCount, device_ordinal));
  for (uintptr_t b : peer_bases) g->buffers.push_back(reinterpret_cast<char*>(b));
  g->info.pes = pes;
  return insert_group(std::move(g), set_id, id_out);
}

Status set_receive_pool(int64_t id, uintptr_t begin, int64_t bytes, const std::vector<int64_t>& delta) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  auto it = registry().find(id);
  if (it == registry().end()) return Status::Error("no group with id " + std::to_string(id));
  GroupInfo& info = it->second->info;
  const int n = static_cast<int>(info.device_ordinals.size());
  if (info.owns_buffers) return Status::Error("receive pools are for external groups (one process per GPU)");
  if (n > kMaxNvlPeers || static_cast<int>(delta.size()) != n)
    return Status::Error("a receive pool needs a group of at most " + std::to_string(kMaxNvlPeers) +
                         " ranks and one delta per rank (" + std::to_string(n) + "), got " +
                         std::to_string(delta.size()));
  for (char* b : it->second->buffers)
    if (b == nullptr) return Status::Error("a receive pool needs every rank of the group mapped (one host)");
  if (begin == 0 || bytes <= 0) return Status::Error("a receive pool needs a non-empty address range");
  info.receive_pool_begin = begin;
  info.receive_pool_end = begin + static_cast<uintptr_t>(bytes);
  info.receive_delta = delta;
  bump_generation();
  return Status::Ok();
}

Status warmup_group(int64_t id, uint64_t timeout_ns) {
  GroupInfo info;
  std::vector<char*> bases;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex());
    auto it = registry().find(id);
    if (it == registry().end()) return Status::Error("no group with id " + std::to_string(id));
    info = it->second->info;
    bases = it->second->buffers;
  }
  DeviceRestorer restore;
  const int n = static_cast<int>(bases.size());
  std::vector<cudaStream_t> streams(n, nullptr);
  Status st;
  // A group with ranks out of load/store reach (null bases: other hosts) has no device barrier over pointers;
  // its processes met in NVSHMEM's barrier after the allocation (nvshmem/host.cc, malloc_zeroed).
  const bool all_mapped = std::find(bases.begin(), bases.end(), nullptr) == bases.end();
  // Launch on every local device of the group first, then wait: in-process ranks wait for each other.
  for (int r = 0; r < n && st.ok(); ++r) {
    if (info.device_ordinals[r] < 0) continue;
    st = CudaStatus(cudaSetDevice(info.device_ordinals[r]), "cudaSetDevice", __FILE__, __LINE__);
    if (st.ok()) st = layout::preload_kernels();
    if (st.ok()) st = normal::preload_kernels();
    if (st.ok()) st = low_latency::preload_kernels();
    if (st.ok() && all_mapped)
      st = CudaStatus(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                      __FILE__, __LINE__);
    if (st.ok() && all_mapped) {
      GroupCtx ctx{};
      for (int q = 0; q < n; ++q) ctx.peers.base[q] = bases[q];
      ctx.rank = r;
      ctx.num_ranks = n;
      ctx.timeout_ns = timeout_ns;
      st = normal::launch_group_barrier(ctx, streams[r]);
    }
  }
  for (int r = 0; r < n; ++r) {
    if (streams[r] == nullptr) continue;
    cudaSetDevice(info.device_ordinals[r]);
    Status s2 = CudaStatus(cudaStreamSynchronize(streams[r]), "warm-up barrier", __FILE__, __LINE__);
    if (st.ok()) st = s2;
    cudaStreamDestroy(streams[r]);
  }
  return st;
}

Status group_info(int64_t id, GroupInfo* out) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  auto it = registry().find(id);
  if (it == registry().end()) return Status::Error("no group with id " + std::to_string(id));
  *out = it->second->info;
  return Status::Ok();
}

Status bind_axis(const std::string& axis, const AxisBinding& b) {
  if (axis.empty()) return Status::Error("bind_axis: the axis name is empty");
  if (b.set_id < 0) return Status::Error("bind_axis: set_id must be >= 0, got " + std::to_string(b.set_id));
  if (b.low_latency_bytes < 0) return Status::Error("bind_axis: low_latency_bytes must be >= 0, got " + std::to_string(b.low_latency_bytes));
  if (b.low_latency_bytes > 0 && (b.low_latency_offset < kSignalHeaderBytes || b.low_latency_offset % kAlign != 0))
    return Status::Error("bind_axis: low_latency_offset must be a multiple of " + std::to_string(kAlign) + " and >= " +
                         std::to_string(kSignalHeaderBytes) + " (staging_plan), got " + std::to_string(b.low_latency_offset));
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  // Groups of the set that exist now must hold the LL region (handlers check again against the group they find).
  for (auto& [id, g] : registry()) {
    if (g->info.set_id != b.set_id || b.low_latency_bytes == 0) continue;
    if (b.low_latency_offset + b.low_latency_bytes > g->info.buffer_bytes)
      return Status::Error("bind_axis: the low-latency region [" + std::to_string(b.low_latency_offset) + ", +" +
                           std::to_string(b.low_latency_bytes) + ") does not fit group " + std::to_string(id) + "'s " +
                           std::to_string(g->info.buffer_bytes) + "-byte staging buffer");
  }
  bindings()[axis] = b;
  bump_generation();
  return Status::Ok();
}

void unbind_axis(const std::string& axis) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  bindings().erase(axis);
  bump_generation();
}

std::map<std::string, AxisBinding> bound_axes() {
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  return bindings();
}

uint64_t binding_generation() { return generation.load(std::memory_order_acquire); }

Status resolve_axis(const std::string& axis, int device_ordinal, ResolvedGroup* out) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  // NOTE: read under the lock: every bump happens under the exclusive lock, so what is found below belongs to
  // exactly this generation.
  const uint64_t gen = generation.load(std::memory_order_acquire);
  const auto b = bindings().find(axis);
  if (b != bindings().end()) {
    for (auto& [id, g] : registry()) {
      if (g->info.set_id != b->second.set_id) continue;
      const auto& ords = g->info.device_ordinals;
      const auto pos = std::find(ords.begin(), ords.end(), device_ordinal);
      if (pos == ords.end()) continue;
      GroupDeviceView v;
      v.rank = static_cast<int32_t>(pos - ords.begin());
      v.num_ranks = static_cast<int32_t>(ords.size());
      for (int r = 0; r < v.num_ranks; ++r) v.peers.base[r] = g->buffers[r];
      v.buffer_bytes = g->info.buffer_bytes;
      v.sm_count = g->info.sm_counts[v.rank];
      v.in_process = g->info.owns_buffers;
      for (int o : ords) {
        if (o < 0 || o >= 64) v.in_process = false;  // device_mask names ordinals below 64 only
        if (v.in_process) v.device_mask |= uint64_t{1} << o;
      }
      if (!v.in_process) v.device_mask = 0;
      for (int r = 0; r < v.num_ranks && r < static_cast<int>(g->info.pes.size()); ++r) v.pe[r] = g->info.pes[r];
      v.receive_pool_begin = g->info.receive_pool_begin;
      v.receive_pool_end = g->info.receive_pool_end;
      for (size_t r = 0; r < g->info.receive_delta.size() && r < kMaxNvlPeers; ++r)
        v.receive_delta[r] = g->info.receive_delta[r];
      out->view = v;
      out->binding = b->second;
      out->generation = gen;
      out->alive = g->alive;
      return Status::Ok();
    }
  }
  return Status::Error("no jax_ep runtime for mesh axis '" + axis + "' on device " + std::to_string(device_ordinal) +
                       ": call jax_ep.initialize(mesh, cfg) first");
}

}  // namespace jax_ep
