// Direct buffers (one process, normal mode's NVLink kernels): the peers read and write this rank's XLA buffers
// themselves. Dispatch's senders store into the receiver's outputs (direct receive, normal_params.h: RecvTargets);
// combine's reducers read the peers' inputs (pull combine: CombineSource). Whether a call's buffers allow it, and
// the process-wide switch.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace jax_ep::direct_buffers {

// On by default; JAX_EP_DIRECT_BUFFERS=0 in the environment (read once) or set_enabled(false) turns it off: every
// dispatch then receives through staging and the copy-out, every combine sends its rows back into staging.
bool enabled();
void set_enabled(bool on);

// A combine publishes its inputs (and so pulls: its reduce reads the peers' rows) only when its output y holds at
// least pull_combine_min_bytes() bytes; smaller combines push. The default, 2^50 bytes, is larger than any output:
// every combine pushes, since the push combine (its reduce running under its sends) measured faster at every size
// (docs/BENCHMARKS.md). JAX_EP_PULL_COMBINE_MIN_BYTES in the environment (read once) or set_pull_combine_min_bytes()
// changes it. Every rank of a group decides alike: the test reads only the call's static shape and this process-wide
// value.
constexpr int64_t kPullCombineMinBytes = int64_t{1} << 50;
int64_t pull_combine_min_bytes();
void set_pull_combine_min_bytes(int64_t bytes);

// A buffer: its device address and size in bytes.
struct Extent {
  const void* ptr;
  int64_t bytes;
};

// True when every byte of every extent with a non-null pointer lies in allocations that the devices of `device_mask`
// (bit o: CUDA ordinal o) can read and write through their own mappings:
//   - a cudaMalloc / cuMemAlloc allocation on a device of the mask: peer access, which create_group enabled between
//     the group's devices, covers it;
//   - a virtual-memory mapping (cuMemCreate + cuMemMap, what XLA's allocator gives on CUDA 12+): cuMemGetAccess
//     says read-write for every device of the mask (XLA grants its devices access to each other's mappings);
//   - anything else (stream-ordered pools, unknown): false.
// An extent may span several mappings: each is checked. Asks the driver once per mapping and caches the answer by
// address range.
// INVARIANT: an address range, once found addressable, stays so while the process runs: XLA's allocator keeps its
// mappings, and maps anew with the same access. A process that remaps such a range without peer access must turn
// direct buffers off (set_enabled(false) / JAX_EP_DIRECT_BUFFERS=0).
bool peer_addressable(std::initializer_list<Extent> extents, uint64_t device_mask);

// True when every extent with a non-null pointer and bytes > 0 lies inside [begin, end): with one process per GPU, the
// outputs of a dispatch take direct receive only inside this rank's receive pool (receive_pools.h).
bool within(std::initializer_list<Extent> extents, uintptr_t begin, uintptr_t end);

// What the driver says of the allocation holding `ptr` (diagnostics: why a call did not use direct buffers).
struct PointerFacts {
  int query_result = -1;   // CUresult of cuPointerGetAttributes; -1: the entry point was not found
  int legacy_ipc = 0;      // CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: a cudaMalloc / cuMemAlloc allocation
  bool from_pool = false;  // CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE != nullptr
  unsigned long long range_start = 0, range_size = 0;
  int device = -1;         // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
  // cuMemGetAccess for devices 0..7 (CU_MEM_ACCESS_FLAGS_PROT_*: 3 = read-write), -1 where the driver refused
  int access[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
};
PointerFacts describe(const void* ptr);

// Dispatch and combine calls that published their buffers, every device of this process.
int64_t calls();
void count_call();

}  // namespace jax_ep::direct_buffers
