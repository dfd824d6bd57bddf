// What every kernel knows about its group: the peers' staging buffers, its rank, the wait budget. Filled by the
// handlers from the transport's group view (peer_group.h); the same struct serves both process models.
#pragma once

#include <cstdint>

#include "jax_ep/constants.h"
#include "jax_ep/rank_mask.h"
#include "jax_ep/staging_layout.h"

namespace jax_ep {

// Staging buffer base of every rank of the group (this rank's too), as this device addresses them. The in-process
// transport fills it from cudaMalloc + peer access; the one-process-per-GPU transport from nvshmem_ptr.
// NOTE: passed by value in the kernel parameters (constant bank), so no device-side table lookup per access.
struct PeerTable {
  char* base[kMaxGroupRanks];
};

struct GroupCtx {
  PeerTable peers;
  BufferLayout layout;   // normal mode: offsets of this call's config inside every rank's staging (LL: unused)
  int32_t rank;          // this device's rank in the group (= its index along the mesh axis)
  int32_t num_ranks;     // R <= kMaxGroupRanks
  uint64_t timeout_ns;   // device waits trap after this long
  int32_t pe[kMaxGroupRanks];  // one process per GPU: NVSHMEM world PE of every rank (NVSHMEM puts); else -1
  // Normal mode over NVSHMEM (EPConfig.normal_over_nvshmem): rank q set = reached by NVSHMEM puts and signal ops
  // only (another NVLink domain, or no load/store mapping); never this rank. Empty: every rank by pointers.
  RankMask remote;
  // Hierarchical dispatch over NVSHMEM (BufferLayout::fwd_nodes > 0 and `remote` = exactly the ranks of other nodes):
  // the node size num_max_nvl_peers; 0: the flat NVSHMEM kernels (or none).
  int32_t forward_nvl;
};

}  // namespace jax_ep
