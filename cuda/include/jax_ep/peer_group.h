// Transport host API: groups of GPUs that reach each other's staging buffers (CUDA peer access in one process, or
// buffers mapped by the caller, e.g. NVSHMEM, in one process per GPU), and the axis bindings that let compiled
// programs find them.
//
// Everything expensive happens in create_group (allocation, peer access, zeroing, one warm-up barrier). Handlers
// resolve (mesh axis, device ordinal) -> group view through resolve_axis (a shared lock on two small maps, no CUDA
// call) and cache the result per device while its group is alive (ResolvedGroup::alive: an atomic load, no lock).
// Implemented in cuda/transport/peer_group.cc.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "jax_ep/group_ctx.h"
#include "jax_ep/status.h"

namespace jax_ep {

struct GroupInfo {
  int64_t id = -1;
  int64_t set_id = -1;                 // groups created with the same set id serve one bound axis together
  std::vector<int> device_ordinals;    // rank order; -1 for ranks that live in other processes (external groups)
  bool owns_buffers = true;            // false for external groups (NVSHMEM owns the memory)
  int64_t buffer_bytes = 0;
  std::vector<uintptr_t> buffers;      // staging base per rank (device addresses, for diagnostics)
  std::vector<int> sm_counts;
  std::vector<int> pes;                // external groups: NVSHMEM world PE of every rank (empty: not given)
  // External groups with a receive pool (set_receive_pool): this rank's pool [begin, end) and, per rank d, where d
  // addresses a byte of it minus where this rank does. end == begin: none.
  uintptr_t receive_pool_begin = 0, receive_pool_end = 0;
  std::vector<int64_t> receive_delta;
};

// What a handler needs for one device of a group.
struct GroupDeviceView {
  PeerTable peers{};
  int32_t rank = -1;
  int32_t num_ranks = 0;
  int64_t buffer_bytes = 0;
  int32_t sm_count = 0;
  int32_t pe[kMaxGroupRanks];  // GroupInfo::pes, -1 when not given
  // in_process: every rank's device belongs to this process, with peer access enabled between all of them
  // (create_group), so any cudaMalloc'd memory of one is addressable by the others; device_mask: bit o set for the
  // CUDA ordinal o of every rank (0, and in_process false, for external groups and for ordinals >= 64)
  bool in_process = false;
  uint64_t device_mask = 0;
  // One process per GPU: a dispatch's outputs that lie in [receive_pool_begin, receive_pool_end) may take direct
  // receive, published to rank d displaced by receive_delta[d] (GroupInfo; xla_ffi/receive_pools.h). Empty: none.
  uintptr_t receive_pool_begin = 0, receive_pool_end = 0;
  int64_t receive_delta[kMaxNvlPeers] = {};

  GroupDeviceView() {
    for (int32_t& p : pe) p = -1;
  }
};

// device_ordinals: CUDA device ordinals in rank order (jax Device.local_hardware_id along the mesh axis).
// set_id < 0: the group forms its own set (set_id = id). Several groups of one mesh (e.g. dp x ep) pass the id of
// the first as set_id, so one binding serves every device: each finds the group holding it.
Status create_group(const std::vector<int>& device_ordinals, int64_t buffer_bytes, int64_t set_id, int64_t* id_out);
Status destroy_group(int64_t id);

// One-process-per-GPU transports (NVSHMEM): the caller owns the memory (nvshmem_malloc) and has already mapped every
// peer's buffer into this process (nvshmem_ptr). Registers this process's side of an EP group: `rank` in the
// group, the CUDA ordinal it runs on, and peer_bases[r] = rank r's buffer as this device addresses it. The buffer
// must be zeroed by the caller before the first op (e.g. cudaMemset + a collective barrier). No memory is freed by
// destroy_group for such a group. Kernels see exactly what create_group gives them (same PeerTable).
// pes: the NVSHMEM world PE of every rank (for kernels that put through NVSHMEM), or empty.
Status register_external_group(int device_ordinal, int rank, const std::vector<uintptr_t>& peer_bases,
                               int64_t buffer_bytes, int64_t set_id, int64_t* id_out,
                               const std::vector<int>& pes = {});

// One process per GPU (external groups of at most kMaxNvlPeers ranks, every one mapped): registers this rank's
// receive pool, [begin, begin + bytes) of this process, and delta[d] = where rank d addresses a byte of it minus where
// this rank does (delta[rank] = 0). Every rank of the group must register one, or none: with pools, a dispatch's
// ranks each decide whether they take direct receive (DispatchParams::every_rank_staged false). Handlers see it from
// their next resolution on (bumps the generation).
Status set_receive_pool(int64_t id, uintptr_t begin, int64_t bytes, const std::vector<int64_t>& delta);

// Runs one group barrier on this process's device(s) of the group and waits for it: every rank must call it (a
// collective warm-up; in-process groups run it inside create_group). Returns an error instead of hanging when a
// peer does not arrive within timeout_ns (the kernel traps).
Status warmup_group(int64_t id, uint64_t timeout_ns);
Status group_info(int64_t id, GroupInfo* out);

// ---- axis bindings ----------------------------------------------------------------------------------------------
// A handler's `axis` attribute names a mesh axis; the binding of that axis says which group set serves it and where
// the low-latency region lies in those groups' staging. Rebinding replaces (for call sites not yet resolved: those
// that ran keep their group until it is destroyed; xla_ffi/op_state.h, "pinning"). Every change of bindings or
// groups bumps the process-wide generation (never reused).
// NOTE: no CUDA call here: binding works (and is testable) on machines without a GPU.
struct AxisBinding {
  int64_t set_id = -1;
  int64_t low_latency_offset = 0;   // byte offset of the LL region in every group of the set (staging_plan)
  int64_t low_latency_bytes = 0;    // bytes of the LL region, 0: no LL buffers
};

Status bind_axis(const std::string& axis, const AxisBinding& binding);
void unbind_axis(const std::string& axis);  // no error if unbound
std::map<std::string, AxisBinding> bound_axes();
uint64_t binding_generation();              // acquire load; never 0

// What resolve_axis found for (axis, device ordinal), and the generation it was valid for.
struct ResolvedGroup {
  GroupDeviceView view;
  AxisBinding binding;
  uint64_t generation = 0;
  // true until the group is destroyed (before its buffers are freed); a retired group stays alive until finalize
  std::shared_ptr<const std::atomic<bool>> alive;
};

// Handler path (a shared lock, no CUDA call): the group of the set bound to `axis` that holds `device_ordinal`.
// Error: "no jax_ep runtime for mesh axis '<axis>' on device <ordinal>: call jax_ep.initialize(mesh, cfg) first".
Status resolve_axis(const std::string& axis, int device_ordinal, ResolvedGroup* out);

}  // namespace jax_ep
