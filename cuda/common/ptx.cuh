// Memory-ordering primitives for peer (NVLink, system scope) signalling, vector copies, and bounded waits.
#pragma once

#include <cstdint>
#include <cstdio>

namespace jax_ep {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One single-copy-atomic 8-byte store, unordered with this thread's other stores: for words that carry their own
// validity (epoch words), read with ld.acquire.sys.
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Returns the old value. Release: this thread's earlier loads and stores (and, through a __syncthreads before it, its
// block's) happen before the add for every GPU-scope observer; acquire: an add that reads a released add's result
// makes that thread's work happen before this thread's later operations.
__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ void red_add_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Read-only, streamed once: skip L1 (the source rows are not reused by this SM).
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Data written by peers in this op: bypass L1 (L1 is not coherent with peer stores).
__device__ __forceinline__ int4 ld_cg_v4(const int4* p) { return __ldcg(p); }

__device__ __forceinline__ void st_v4(int4* p, const int4& v) { *p = v; }

// Wrap-safe "a has reached b" for the monotonic u32 epochs.
__device__ __forceinline__ bool reached(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

// True for the first caller in this device module (each .cu file is one): a timeout is printed once, not by every
// thread that waits, before the trap ends the CUDA context.
static __device__ unsigned int timeout_reported = 0;
__device__ __forceinline__ bool first_timeout_report() { return atomicExch(&timeout_reported, 1u) == 0u; }

// Spins until epoch_of(load()) has reached `target` (load: an acquire at system scope) and returns the value that did.
// After timeout_ns it prints who waited for whom (once per module) and traps: a peer that never arrives ends the
// program with a message instead of hanging it.
template <class Load, class EpochOf>
__device__ __forceinline__ auto wait_value_reached(Load load, EpochOf epoch_of, uint32_t target, uint64_t timeout_ns,
                                                   const char* what, int rank, int peer, uint32_t backoff_ns = 0) {
  auto v = load();
  if (reached(epoch_of(v), target)) return v;
  const uint64_t start = global_timer_ns();
  while (!reached(epoch_of(v = load()), target)) {
    if (backoff_ns != 0) __nanosleep(backoff_ns);
    if (global_timer_ns() - start > timeout_ns) {
      if (first_timeout_report())
        printf("jax_ep: timeout after %llu ns in %s: rank %d waited for rank %d (epoch %u, flag %u); ranks are "
               "probably running different programs. Trapping.\n",
               static_cast<unsigned long long>(timeout_ns), what, rank, peer, target, epoch_of(v));
      __trap();
    }
  }
  return v;
}

// Spins until *flag (an epoch) has reached `target`; as wait_value_reached.
__device__ __forceinline__ void wait_reached(const uint32_t* flag, uint32_t target, uint64_t timeout_ns,
                                             const char* what, int rank, int peer, uint32_t backoff_ns = 0) {
  wait_value_reached([flag] { return ld_acquire_sys(flag); }, [](uint32_t v) { return v; }, target, timeout_ns, what,
                     rank, peer, backoff_ns);
}

// An epoch word: the epoch in the high half, a 32-bit value written with it in the low half, one release store.
__device__ __forceinline__ uint64_t epoch_word(uint32_t epoch, uint32_t value) {
  return (static_cast<uint64_t>(epoch) << 32) | value;
}

// Spins until the epoch of *word has reached `target`; returns the word (its value: static_cast<uint32_t>).
__device__ __forceinline__ uint64_t wait_word_reached(const uint64_t* word, uint32_t target, uint64_t timeout_ns,
                                                      const char* what, int rank, int peer) {
  return wait_value_reached([word] { return ld_acquire_sys_u64(word); },
                            [](uint64_t v) { return static_cast<uint32_t>(v >> 32); }, target, timeout_ns, what, rank,
                            peer);
}

}  // namespace jax_ep
