// What the kernels' loops over the ranks of a group cost as R grows, apart from waiting for peers
// (docs/INTERNODE_SCALING.md, "What grows with R per op"). GPU 0 plays rank 0 of a group of R ranks; the R-1 other
// "ranks" are slices of one buffer on GPU 1 (stores and atomics cross NVLink as to real peers; with one GPU, slices of
// its own memory). Every flag a loop waits for is set before the kernel starts, so what is timed is the loop itself,
// with the kernels' own device functions (transport/peer.cuh, common/source_of_row.cuh). Each case runs ITERS
// times inside one launch (global timer), printed as us per op:
//   barrier          group_barrier_block in one block of 256 threads: R release arrivals into the ranks, R flags read
//   arrive           group_arrive_block without release (what a dispatch's notify posts)
//   data wait        wait_data_kernel's loop: one warp, R flags
//   count publish    notify's exchange: this rank's R counts into every rank (R x R int stores), then R signals
//   count read       the R x R counts read back (ld.cg) and summed per source, one block of 256
//   source lookup    source_of_row (binary search) over R prefix offsets for 4096 rows, one block of 256 (copy-out,
//                    LL receive)
//   scripts/gpu.sh rank-loops   (or: nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Icuda -Icuda/include \
//                               -o /tmp/rank_loops scripts/rank_loops.cu && /tmp/rank_loops)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/source_of_row.cuh"
#include "transport/peer.cuh"              // group_barrier_block, group_arrive_block, wait_peer, signal_peer

using namespace jax_ep;
using jax_ep::source_of_row;

constexpr int kIters = 200;
constexpr int kRows = 4096;

// Bytes of one rank's slice: the signal header, then the R x R count matrix.
int64_t slice_bytes(int R) { return align_up(kSignalHeaderBytes + 4LL * R * R, 4096); }

__device__ int32_t* counts_of(char* base) { return reinterpret_cast<int32_t*>(base + kSignalHeaderBytes); }

// Case c of the list above, kIters times; out[0] = ns for all of them, out[1] = a checksum (keeps the loads).
__global__ void __launch_bounds__(256) rank_loop(const __grid_constant__ GroupCtx g, int c, unsigned long long* out) {
  __shared__ int32_t off[kMaxGroupRanks + 1];
  __shared__ unsigned long long sum;
  const int R = g.num_ranks;
  if (threadIdx.x == 0) {
    sum = 0;
    off[0] = 0;
    for (int s = 0; s < R; ++s) off[s + 1] = off[s] + kRows / R + (s < kRows % R);
  }
  __syncthreads();
  const uint64_t start = global_timer_ns();
  unsigned long long local = 0;
  for (int it = 0; it < kIters; ++it) {
    if (c == 0) {
      group_barrier_block(g, "rank_loops barrier");
    } else if (c == 1) {
      group_arrive_block(g, false);
    } else if (c == 2) {
      if (threadIdx.x < 32)
        for (int s = threadIdx.x; s < R; s += 32) wait_peer(g, s, SignalHeader::kDataFlag, 1u, "rank_loops wait");
    } else if (c == 3) {
      for (int i = threadIdx.x; i < R * R; i += blockDim.x)
        counts_of(peer_base(g, i / R))[g.rank * R + i % R] = it + i;
      __syncthreads();
      for (int d = threadIdx.x; d < R; d += blockDim.x) signal_peer(g, d, SignalHeader::kCountFlag, it + 1);
    } else if (c == 4) {
      for (int i = threadIdx.x; i < R * R; i += blockDim.x) local += __ldcg(counts_of(self_base(g)) + i);
    } else {
      for (int i = threadIdx.x; i < kRows; i += blockDim.x) local += source_of_row(off, R, (i * 7 + it) % kRows);
    }
    __syncthreads();
  }
  const uint64_t ns = global_timer_ns() - start;
  atomicAdd(&sum, local);
  __syncthreads();
  if (threadIdx.x == 0) {
    out[0] = ns;
    out[1] = sum;
  }
}

int main() {
  int gpus = 0;
  cudaGetDeviceCount(&gpus);
  const int far = gpus > 1 ? 1 : 0;
  const char* names[] = {"barrier", "arrive", "data wait", "count publish", "count read", "source lookup"};
  const int ranks[] = {8, 16, 32, 64, 128, 256};
  printf("rank_loops: rank 0 on GPU 0, the other ranks' slices on GPU %d; us per op (%d ops per launch)\n", far,
         kIters);
  printf("| R |");
  for (const char* n : names) printf(" %s |", n);
  printf("\n|---|---|---|---|---|---|---|\n");
  for (int R : ranks) {
    const int64_t bytes = slice_bytes(R);
    char *mine = nullptr, *others = nullptr;
    cudaSetDevice(far);
    cudaMalloc(&others, bytes * R);
    cudaMemset(others, 0, bytes * R);
    cudaSetDevice(0);
    if (far != 0) cudaDeviceEnablePeerAccess(far, 0);
    cudaGetLastError();  // "already enabled" from an earlier R
    cudaMalloc(&mine, bytes);
    cudaMemset(mine, 0, bytes);
    // every flag rank 0 waits for is already far ahead: arrivals of every rank, data flags
    uint32_t* flags = static_cast<uint32_t*>(malloc(SignalHeader::kU32PerRank));
    for (int s = 0; s < kMaxGroupRanks; ++s) flags[s] = 1u << 30;
    cudaMemcpy(mine + SignalHeader::kBarrierIn, flags, SignalHeader::kU32PerRank, cudaMemcpyHostToDevice);
    cudaMemcpy(mine + SignalHeader::kDataFlag, flags, SignalHeader::kU32PerRank, cudaMemcpyHostToDevice);
    free(flags);
    GroupCtx g;
    memset(&g, 0, sizeof(g));
    g.rank = 0;
    g.num_ranks = R;
    g.timeout_ns = 10ull * 1000 * 1000 * 1000;
    g.peers.base[0] = mine;
    for (int r = 1; r < R; ++r) g.peers.base[r] = others + bytes * r;
    unsigned long long* out = nullptr;
    cudaMalloc(&out, 16);
    printf("| %d |", R);
    for (int c = 0; c < 6; ++c) {
      unsigned long long h[2] = {0, 0};
      for (int rep = 0; rep < 2; ++rep) {  // the second launch is timed
        rank_loop<<<1, 256>>>(g, c, out);
        cudaDeviceSynchronize();
      }
      cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost);
      printf(" %.2f |", h[0] / 1e3 / kIters);
    }
    printf("\n");
    cudaFree(out);
    cudaFree(mine);
    cudaSetDevice(far);
    cudaFree(others);
    cudaSetDevice(0);
  }
  const cudaError_t e = cudaGetLastError();
  printf("rank_loops: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
