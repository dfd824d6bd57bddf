#include "direct_buffers.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "driver_entry.h"

namespace jax_ep::direct_buffers {
namespace {

std::atomic<bool>& switch_state() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("JAX_EP_DIRECT_BUFFERS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }()};
  return on;
}

std::atomic<int64_t>& pull_threshold() {
  static std::atomic<int64_t> bytes{[] {
    const char* v = std::getenv("JAX_EP_PULL_COMBINE_MIN_BYTES");
    char* end = nullptr;
    const long long n = v == nullptr ? -1 : std::strtoll(v, &end, 10);
    return v != nullptr && *v != '\0' && *end == '\0' && n >= 0 ? static_cast<int64_t>(n) : kPullCombineMinBytes;
  }()};
  return bytes;
}

std::atomic<int64_t>& call_count() {
  static std::atomic<int64_t> n{0};
  return n;
}

using PointerGetAttributes = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);
using MemGetAccess = CUresult (*)(unsigned long long*, const CUmemLocation*, CUdeviceptr);

PointerGetAttributes pointer_get_attributes() {
  static const auto fn = reinterpret_cast<PointerGetAttributes>(driver_entry("cuPointerGetAttributes"));
  return fn;
}

MemGetAccess mem_get_access() {
  static const auto fn = reinterpret_cast<MemGetAccess>(driver_entry("cuMemGetAccess"));
  return fn;
}

// cuMemGetAccess of `ptr` for device `ordinal`, -1 where the driver refuses (not a virtual-memory mapping).
int access_of(const void* ptr, int ordinal) {
  const MemGetAccess get = mem_get_access();
  if (get == nullptr) return -1;
  CUmemLocation loc{};
  loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
  loc.id = ordinal;
  unsigned long long flags = 0;
  return get(&flags, &loc, reinterpret_cast<CUdeviceptr>(ptr)) == CUDA_SUCCESS ? static_cast<int>(flags) : -1;
}

struct Range {
  uintptr_t begin, end;
  uint64_t devices;  // the device mask the range was found addressable by
};

std::mutex cache_mu;
std::vector<Range> cache;  // guarded by cache_mu
constexpr size_t kMaxCachedRanges = 256;

// The end of the cached range that holds p and was found addressable by every device of mask, or 0.
uintptr_t cached_end(uintptr_t p, uint64_t mask) {
  for (const Range& r : cache)
    if (p >= r.begin && p < r.end && (mask & ~r.devices) == 0) return r.end;
  return 0;
}

// Asks the driver whether the allocation holding p is addressable by every device of mask; its range when so.
bool ask_driver(const void* p, uint64_t mask, Range* range) {
  const PointerFacts f = describe(p);
  if (f.query_result != CUDA_SUCCESS || f.from_pool || f.range_size == 0) return false;
  if (f.legacy_ipc == 1) {  // cudaMalloc: peer access covers it where its device is one of the group's
    if (f.device < 0 || f.device >= 64 || !(mask >> f.device & 1u)) return false;
  } else {  // a virtual-memory mapping: access is per device
    for (int o = 0; o < 64; ++o)
      if ((mask >> o & 1u) && access_of(p, o) != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return false;
  }
  *range = {static_cast<uintptr_t>(f.range_start), static_cast<uintptr_t>(f.range_start + f.range_size), mask};
  return true;
}

}  // namespace

bool enabled() { return switch_state().load(std::memory_order_relaxed); }
void set_enabled(bool on) { switch_state().store(on, std::memory_order_relaxed); }
int64_t pull_combine_min_bytes() { return pull_threshold().load(std::memory_order_relaxed); }
void set_pull_combine_min_bytes(int64_t bytes) { pull_threshold().store(bytes, std::memory_order_relaxed); }

PointerFacts describe(const void* ptr) {
  PointerFacts f;
  const PointerGetAttributes query = pointer_get_attributes();
  if (query == nullptr) return f;
  void* pool = nullptr;
  CUdeviceptr start = 0;
  size_t size = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                                 CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* out[] = {&f.legacy_ipc, &pool, &start, &size, &f.device};
  f.query_result = static_cast<int>(query(5, attrs, out, reinterpret_cast<CUdeviceptr>(ptr)));
  f.from_pool = pool != nullptr;
  f.range_start = start;
  f.range_size = size;
  for (int o = 0; o < 8; ++o) f.access[o] = access_of(ptr, o);
  return f;
}

bool peer_addressable(std::initializer_list<Extent> extents, uint64_t device_mask) {
  std::lock_guard<std::mutex> lock(cache_mu);
  for (const Extent& e : extents) {
    if (e.ptr == nullptr || e.bytes <= 0) continue;
    const uintptr_t end = reinterpret_cast<uintptr_t>(e.ptr) + static_cast<uintptr_t>(e.bytes);
    for (uintptr_t p = reinterpret_cast<uintptr_t>(e.ptr); p < end;) {  // mapping by mapping
      if (const uintptr_t next = cached_end(p, device_mask)) {
        p = next;
        continue;
      }
      Range r{};
      if (!ask_driver(reinterpret_cast<const void*>(p), device_mask, &r) || r.end <= p) return false;
      if (cache.size() >= kMaxCachedRanges) cache.clear();
      cache.push_back(r);
      p = r.end;
    }
  }
  return true;
}

bool within(std::initializer_list<Extent> extents, uintptr_t begin, uintptr_t end) {
  for (const Extent& e : extents) {
    if (e.ptr == nullptr || e.bytes <= 0) continue;
    const uintptr_t p = reinterpret_cast<uintptr_t>(e.ptr);
    if (p < begin || p >= end || static_cast<uintptr_t>(e.bytes) > end - p) return false;
  }
  return true;
}

int64_t calls() { return call_count().load(std::memory_order_relaxed); }
void count_call() { call_count().fetch_add(1, std::memory_order_relaxed); }

}  // namespace jax_ep::direct_buffers
