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
  std::vector<int> device_ordinals;    // rank order
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
Status group_info(int64_t id, GroupInfo* out);

// Handler path: the group of set `set_id` that holds `device_ordinal`.
Status find_group_device(int64_t set_id, int device_ordinal, GroupDeviceView* out);

}  // namespace jax_ep
