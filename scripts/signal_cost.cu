// What a flag costs between two GPUs over NVLink, per way of ordering a message before it (the kernels' signals:
// cuda/transport/peer.cuh). Two kernels ping-pong: 256 threads store 1 KB into the peer, __syncthreads, thread 0
// signals; the peer acquires the flag (ld.acquire.sys), checks the 1 KB, answers the same way. Prints the round
// trip and the time thread 0 spends in the signal, per variant, and the data mismatches seen (0 expected for every
// variant but the last, which has no ordering at all).
//   scripts/gpu.sh signal-cost     (or: nvcc -O3 -arch=sm_90 -Icuda -Icuda/include -o /tmp/signal_cost \
//                                  scripts/signal_cost.cu && \
//                                  CUDA_VISIBLE_DEVICES=0,1 /tmp/signal_cost)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "common/ptx.cuh"  // the kernels' own acquire / release / timer primitives

using jax_ep::global_timer_ns;
using jax_ep::ld_acquire_sys;

// The orderings without a helper in ptx.cuh (the kernels do not use them).
__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Variant V of the signal after the 1 KB: 0 a full fence then a release store (the kernels before 0257ee2); 1 a
// release store (the kernels now); 2 and 3 a fence then a relaxed store; 4 the arrival counter's release add; 5 a
// relaxed store without ordering (a lower bound: its data checks may fail).
template <int V>
__device__ __forceinline__ void signal(uint32_t* f, uint32_t v) {
  if (V == 0 || V == 3) __threadfence_system();
  if (V == 2) fence_acq_rel_sys();
  if (V == 0 || V == 1) jax_ep::st_release_sys(f, v);
  if (V == 2 || V == 3 || V == 5) st_relaxed_sys(f, v);
  if (V == 4) jax_ep::red_add_release_sys(f, 1u);
}

// data_remote / flag_remote: the peer's; flag_local: mine. 256 threads write 1 KB to the peer, bar.sync, thread 0
// signals.
template <int V>
__global__ void pingpong(int* data_remote, uint32_t* flag_remote, const uint32_t* flag_local, const int* data_local,
                         int iters, bool initiator, unsigned long long* out) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  unsigned long long sig = 0;
  const uint64_t start = global_timer_ns();
  for (int i = 1; i <= iters; ++i) {
    if (!initiator) {
      if (threadIdx.x == 0) while (ld_acquire_sys(flag_local) < (uint32_t)i) {}
      __syncthreads();
      if (__ldcg(data_local + threadIdx.x) != i) atomicAdd(&bad, 1);
    }
    data_remote[threadIdx.x] = i;
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint64_t a = global_timer_ns();
      signal<V>(flag_remote, static_cast<uint32_t>(i));
      sig += global_timer_ns() - a;
    }
    if (initiator) {
      if (threadIdx.x == 0) while (ld_acquire_sys(flag_local) < (uint32_t)i) {}
      __syncthreads();
      if (__ldcg(data_local + threadIdx.x) != i) atomicAdd(&bad, 1);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) { out[0] = global_timer_ns() - start; out[1] = sig; out[2] = bad; }
}

template <int V>
void run(const char* name, int* data[2], uint32_t* flag[2], unsigned long long* out[2]) {
  const int iters = 2000;
  for (int rep = 0; rep < 2; ++rep) {
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      cudaMemset(flag[d], 0, 4);
      cudaMemset(data[d], 0, 1024);
      cudaDeviceSynchronize();
    }
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      pingpong<V><<<1, 256>>>(data[1 - d], flag[1 - d], flag[d], data[d], iters, d == 0, out[d]);
    }
    unsigned long long h[2][3];
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      cudaDeviceSynchronize();
      cudaMemcpy(h[d], out[d], sizeof(h[d]), cudaMemcpyDeviceToHost);
    }
    if (rep == 1)
      printf("%-44s round trip %6.2f us   signal op (thread 0) %5.2f us   data mismatches %llu/%llu\n", name,
             h[0][0] / 1e3 / iters, h[0][1] / 1e3 / iters, h[0][2], h[1][2]);
  }
}

int main() {
  int* data[2]; uint32_t* flag[2]; unsigned long long* out[2];
  for (int d = 0; d < 2; ++d) {
    cudaSetDevice(d); cudaDeviceEnablePeerAccess(1 - d, 0);
    cudaMalloc(&data[d], 1024); cudaMalloc(&flag[d], 256); cudaMalloc(&out[d], 64);
  }
  run<0>("threadfence_system + st.release.sys", data, flag, out);
  run<1>("st.release.sys", data, flag, out);
  run<2>("fence.acq_rel.sys + st.relaxed.sys", data, flag, out);
  run<3>("threadfence_system + st.relaxed.sys", data, flag, out);
  run<4>("red.release.sys.add", data, flag, out);
  run<5>("st.relaxed.sys only (no ordering: lower bound)", data, flag, out);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
