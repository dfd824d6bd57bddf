// In-process transport: one process drives the GPUs of an EP group; peers reach each other's staging buffers
// through CUDA peer access (NVLink). Host side: create / destroy / look up groups.
//
// Everything expensive happens in create_group (allocation, peer access, zeroing, one warm-up barrier); the
// per-call lookup used by the FFI handlers takes a shared lock on a small map and makes no CUDA calls.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "jax_ep/params.h"
#include "jax_ep/status.h"

namespace jax_ep {

struct GroupInfo {
  int64_t id = -1;
  int64_t set_id = -1;                 // groups created with the same set id answer the same handler attribute
  std::vector<int> device_ordinals;    // rank order; -1 for ranks that live in other processes (external groups)
  bool owns_buffers = true;            // false for external groups (NVSHMEM owns the memory)
  int64_t buffer_bytes = 0;
  std::vector<uintptr_t> buffers;      // staging base per rank (device addresses, for diagnostics)
  std::vector<int> sm_counts;
};

// What a handler needs for one device of a group.
struct GroupDeviceView {
  PeerTable peers{};
  int32_t rank = -1;
  int32_t num_ranks = 0;
  int64_t buffer_bytes = 0;
  int32_t sm_count = 0;
};

// device_ordinals: CUDA device ordinals in rank order (jax Device.local_hardware_id along the mesh axis).
// set_id < 0: the group forms its own set (set_id = id). Several groups of one mesh (e.g. dp x ep) pass the id of
// the first as set_id, so one handler attribute value serves every device: each finds the group holding it.
Status create_group(const std::vector<int>& device_ordinals, int64_t buffer_bytes, int64_t set_id, int64_t* id_out);
Status destroy_group(int64_t id);

// One-process-per-GPU transports (NVSHMEM): the caller owns the memory (nvshmem_malloc) and has already mapped every
// peer's buffer into this process (nvshmem_ptr). Registers this process's side of an EP group: `rank` in the
// group, the CUDA ordinal it runs on, and peer_bases[r] = rank r's buffer as this device addresses it. The buffer
// must be zeroed by the caller before the first op (e.g. cudaMemset + a collective barrier). No memory is freed by
// destroy_group for such a group. Kernels see exactly what create_group gives them (same PeerTable).
Status register_external_group(int device_ordinal, int rank, const std::vector<uintptr_t>& peer_bases,
                               int64_t buffer_bytes, int64_t set_id, int64_t* id_out);

// Runs one group barrier on this process's device(s) of the group and waits for it: every rank must call it (a
// collective warm-up; in-process groups run it inside create_group). Returns an error instead of hanging when a
// peer does not arrive within timeout_ns (the kernel traps).
Status warmup_group(int64_t id, uint64_t timeout_ns);
Status group_info(int64_t id, GroupInfo* out);

// Handler path: the group of set `set_id` that holds `device_ordinal`.
Status find_group_device(int64_t set_id, int device_ordinal, GroupDeviceView* out);

}  // namespace jax_ep
