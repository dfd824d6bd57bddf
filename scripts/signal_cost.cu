// What a flag costs between two GPUs over NVLink, per way of ordering a message before it (the kernels' signals:
// cuda/transport/peer.cuh). Two kernels ping-pong: 256 threads store 1 KB into the peer, __syncthreads, thread 0
// signals; the peer acquires the flag (ld.acquire.sys), checks the 1 KB, answers the same way. Prints the round
// trip and the time thread 0 spends in the signal, per variant, and the data mismatches seen (0 expected for every
// variant but the last, which has no ordering at all).
//   scripts/gpu.sh signal-cost     (or: nvcc -O3 -arch=sm_90 -o /tmp/signal_cost scripts/signal_cost.cu && \
//                                  CUDA_VISIBLE_DEVICES=0,1 /tmp/signal_cost)
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ uint64_t now() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint32_t ld_acq(const uint32_t* p) { uint32_t v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }

template <int V>
__device__ __forceinline__ void signal(uint32_t* f, uint32_t v) {
  if (V == 0) { __threadfence_system(); asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(f), "r"(v) : "memory"); }
  if (V == 1) { asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(f), "r"(v) : "memory"); }
  if (V == 2) { asm volatile("fence.acq_rel.sys;" ::: "memory"); asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(f), "r"(v) : "memory"); }
  if (V == 3) { asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(f), "r"(v) : "memory"); }
  if (V == 4) { __threadfence_system(); asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(f), "r"(v) : "memory"); }
  if (V == 5) { asm volatile("red.release.sys.global.add.u32 [%0], %1;" :: "l"(f), "r"(1u) : "memory"); }
}

// data_remote / flag_remote: the peer's; flag_local: mine. 256 threads write 1 KB to the peer, bar.sync, thread 0 signals.
template <int V>
__global__ void pingpong(int* data_remote, uint32_t* flag_remote, const uint32_t* flag_local, const int* data_local,
                         int iters, bool initiator, unsigned long long* out) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  unsigned long long sig = 0;
  const uint64_t start = now();
  for (int i = 1; i <= iters; ++i) {
    if (!initiator) {
      if (threadIdx.x == 0) while (ld_acq(flag_local) < (uint32_t)i) {}
      __syncthreads();
      if (__ldcg(data_local + threadIdx.x) != i) atomicAdd(&bad, 1);
    }
    data_remote[threadIdx.x] = i;
    __syncthreads();
    if (threadIdx.x == 0) { const uint64_t a = now(); signal<V>(flag_remote, (uint32_t)i); sig += now() - a; }
    if (initiator) {
      if (threadIdx.x == 0) while (ld_acq(flag_local) < (uint32_t)i) {}
      __syncthreads();
      if (__ldcg(data_local + threadIdx.x) != i) atomicAdd(&bad, 1);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) { out[0] = now() - start; out[1] = sig; out[2] = bad; }
}

template <int V>
void run(const char* name, int* data[2], uint32_t* flag[2], unsigned long long* out[2]) {
  const int iters = 2000;
  for (int rep = 0; rep < 2; ++rep) {
    for (int d = 0; d < 2; ++d) { cudaSetDevice(d); cudaMemset(flag[d], 0, 4); cudaMemset(data[d], 0, 1024); cudaDeviceSynchronize(); }
    for (int d = 0; d < 2; ++d) {
      cudaSetDevice(d);
      pingpong<V><<<1, 256>>>(data[1 - d], flag[1 - d], flag[d], data[d], iters, d == 0, out[d]);
    }
    unsigned long long h[2][3];
    for (int d = 0; d < 2; ++d) { cudaSetDevice(d); cudaDeviceSynchronize(); cudaMemcpy(h[d], out[d], sizeof(h[d]), cudaMemcpyDeviceToHost); }
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
  run<0>("threadfence_system + st.release.sys (now)", data, flag, out);
  run<1>("st.release.sys", data, flag, out);
  run<2>("fence.acq_rel.sys + st.relaxed.sys", data, flag, out);
  run<4>("threadfence_system + st.relaxed.sys", data, flag, out);
  run<5>("red.release.sys.add", data, flag, out);
  run<3>("st.relaxed.sys only (no ordering: lower bound)", data, flag, out);
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
