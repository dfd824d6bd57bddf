// Test hook JAX_EP_TEST_PHASES=1 (read when a module's kernels are preloaded, at initialize): kernels add, at named
// points, the time since their block started to per-device sums, so a bench can split a kernel's duration into
// phases (python -m jax_ep.bench.chain_gaps prints them). Thread 0 of a block stamps; a phase of "each block" is
// averaged over blocks, a phase of "the last block" is timed from that block's own start. %globaltimer is one
// device-wide clock, so stamps of different blocks compare. Off (one load of PhaseSums::on per stamp in thread 0)
// unless armed.
// Each kernel set owns one PhaseSums (a __device__ variable of its translation unit, or one extern variable where the
// module is linked with relocatable device code) and one list of phase names; phase_sums_arm / phase_sums_read move
// it between host and the current device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/ptx.cuh"
#include "jax_ep/status.h"

namespace jax_ep {

constexpr int kMaxPhases = 16;

struct PhaseSums {
  uint32_t on;
  unsigned long long ns[kMaxPhases];    // summed ns from the stamping block's start
  unsigned long long hits[kMaxPhases];  // stamps
};

// This block's start, written by thread 0 before the kernel's first __syncthreads, read after it.
__device__ __forceinline__ uint64_t& block_start_ns() {
  __shared__ uint64_t start;
  return start;
}

__device__ __forceinline__ void phase_begin(const PhaseSums& s) {
  if (threadIdx.x == 0 && s.on) block_start_ns() = global_timer_ns();
}

__device__ __forceinline__ void phase_add(PhaseSums& s, int phase) {
  atomicAdd(&s.ns[phase], static_cast<unsigned long long>(global_timer_ns() - block_start_ns()));
  atomicAdd(&s.hits[phase], 1ull);
}

__device__ __forceinline__ void phase_stamp(PhaseSums& s, int phase) {
  if (threadIdx.x == 0 && s.on) phase_add(s, phase);
}

// phase_stamp from lane 0 of the calling warp (a phase that a warp other than warp 0 reaches), timed from this
// block's start as thread 0 recorded it (phase_begin runs before the block's first __syncthreads).
__device__ __forceinline__ void phase_stamp_lane0(PhaseSums& s, int phase) {
  if ((threadIdx.x & 31u) == 0 && s.on) phase_add(s, phase);
}

// Host side, on the current device. Arms `sym` when JAX_EP_TEST_PHASES=1, else disarms it; the sums start at 0.
template <typename Sym>
Status phase_sums_arm(const Sym& sym) {
  const char* v = std::getenv("JAX_EP_TEST_PHASES");
  PhaseSums h{};
  h.on = v != nullptr && std::strcmp(v, "1") == 0 ? 1u : 0u;
  const cudaError_t e = cudaMemcpyToSymbol(sym, &h, sizeof(h));
  if (e != cudaSuccess) return Status::Error(std::string("phase stamps: ") + cudaGetErrorString(e));
  return Status::Ok();
}

// Adds the current device's sums of `sym` to ns / hits (each kMaxPhases long); with reset, zeroes them there.
template <typename Sym>
Status phase_sums_read(const Sym& sym, bool reset, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits) {
  PhaseSums h{};
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(&h, sym, sizeof(h));
  if (e == cudaSuccess && reset) {
    PhaseSums zero{};
    zero.on = h.on;
    e = cudaMemcpyToSymbol(sym, &zero, sizeof(zero));
  }
  if (e != cudaSuccess) return Status::Error(std::string("phase stamps: ") + cudaGetErrorString(e));
  ns->resize(kMaxPhases, 0);
  hits->resize(kMaxPhases, 0);
  for (int i = 0; i < kMaxPhases; ++i) {
    (*ns)[i] += h.ns[i];
    (*hits)[i] += h.hits[i];
  }
  return Status::Ok();
}

// The devices whose copy of one kernel set's sums were armed (its preload runs once per device of each group), so a
// process driving several GPUs reads the sum over them.
class PhaseDevices {
 public:
  template <typename Sym>
  Status arm(const Sym& sym) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return Status::Error("phase stamps: cudaGetDevice failed");
    Status st = phase_sums_arm(sym);
    if (!st.ok()) return st;
    std::lock_guard<std::mutex> lock(mu_);
    for (int d : devices_)
      if (d == dev) return Status::Ok();
    devices_.push_back(dev);
    return Status::Ok();
  }

  // Adds the sums of every armed device to ns / hits (phase_sums_read); the current device is restored.
  template <typename Sym>
  Status read(const Sym& sym, bool reset, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits) {
    ns->resize(kMaxPhases, 0);
    hits->resize(kMaxPhases, 0);
    int current = 0;
    if (cudaGetDevice(&current) != cudaSuccess) return Status::Error("phase stamps: cudaGetDevice failed");
    std::vector<int> devices;
    {
      std::lock_guard<std::mutex> lock(mu_);
      devices = devices_;
    }
    Status st;
    for (int d : devices) {
      if (cudaSetDevice(d) != cudaSuccess) {
        st = Status::Error("phase stamps: cudaSetDevice failed");
        break;
      }
      st = phase_sums_read(sym, reset, ns, hits);
      if (!st.ok()) break;
    }
    cudaSetDevice(current);
    return st;
  }

 private:
  std::mutex mu_;
  std::vector<int> devices_;
};

}  // namespace jax_ep
