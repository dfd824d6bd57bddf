// Receive pools (one process per GPU, normal mode's NVLink kernels): every process of an EP group maps the memory
// pool XLA allocates its buffers from (XLA's preallocated pool: one cuMemCreate allocation, exportable as a POSIX
// file descriptor) of every other process of the group, so a dispatch's senders store straight into the receiver's
// outputs (direct receive, normal_params.h: RecvTargets) as in one process. jax_ep/runtime/receive_pools.py passes
// the descriptors between the processes and registers the result with the group (peer_group.h: set_receive_pool).
#pragma once

#include <cstdint>
#include <string>

#include "jax_ep/status.h"

namespace jax_ep::receive_pools {

// The mapping (cuMemMap range) that holds `ptr`, a buffer XLA gave this process.
struct Exported {
  int fd = -1;           // the allocation as a POSIX file descriptor (the caller closes it)
  uintptr_t base = 0;    // the mapping's first byte in this process
  int64_t bytes = 0;     // its size
};

// Exports the allocation behind the mapping holding `ptr`. Error (with the driver's reason) when it is not a
// virtual-memory mapping or does not allow POSIX file descriptors. The importer assumes the mapping starts at the
// allocation's first byte and checks it (import_pool's probe).
Status export_pool(uintptr_t ptr, Exported* out);

// Maps the allocation of `fd` (exported by process `pid` from its mapping at `base`, `bytes` long) read-write for
// device `ordinal` of this process; *local: where this process addresses the mapping's first byte. A mapping of
// (pid, base, bytes) made before is reused; mappings stay until the process exits (the exporter's pool lives as long
// as its process). Then reads `expect.size()` bytes at local + probe_offset and fails unless they equal `expect`.
Status import_pool(int fd, int64_t pid, uintptr_t base, int64_t bytes, int ordinal, int64_t probe_offset,
                   const std::string& expect, uintptr_t* local);

}  // namespace jax_ep::receive_pools
