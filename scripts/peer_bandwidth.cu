// NVLink bandwidth per GPU when every visible GPU (2 to 8) sends to every other at once, the all-to-all of a MoE
// dispatch (or, pulling, reads from every other, as a pull combine), per copy method and number of blocks B (one per
// SM). One process drives all GPUs, peer access on between
// every pair. Per launch each GPU reads ROWS rows of ROW_BYTES from its own memory, each once, and stores every row
// into its own slot of every peer's receive buffer (fan-out, like dispatch): egress = ROWS * ROW_BYTES * (G - 1).
// Rows go to blocks round-robin. Methods:
//   sm_stores   512 threads, a warp per row: 8 ld.global.nc 16-byte vectors per lane in flight, then plain stores to
//               every peer (fan_out_row in cuda/kernels/normal_device.cuh)
//   tma         one thread per block runs a ring of row-sized shared-memory stages (about 200 KB): a bulk load
//               (cp.async.bulk, mbarrier) per row, one bulk store per peer from the stage (bulk_group)
//   tma_4warps  the same with four producer warps per block, each its own quarter of the ring
//   tma_4k      tma with the stores split into 4 KB bulk copies
//   pull: ...   the reverse (a pull combine's reads): each GPU reads every peer's rows into its own receive buffer,
//               per (row, peer) item: sm_loads (a warp, 8 loads per lane in flight, then local stores), tma (a bulk
//               load from the peer into a ring stage, a bulk store into local memory), tma_4warps; GB/s = ingress
// Each cell: 3 warm-up + 10 timed launches on all GPUs together (a stream and events per GPU), the median over
// launches of the slowest GPU's event time; GB/s = egress (pull: ingress) bytes per GPU / that time. After each
// method's runs sampled rows of every slot are compared with their source on the host.
//   scripts/gpu.sh peer-bandwidth, or
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icuda -Icuda/include -o /tmp/peer_bandwidth scripts/peer_bandwidth.cu
//   /tmp/peer_bandwidth [ROWS [ROW_BYTES]]   (defaults 4096 and 14336 = 7168 bf16; ROW_BYTES a multiple of 16)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/ptx.cuh"     // ld_nc_v4, st_v4: the send kernels' vector copies
#include "common/thread.cuh"  // lane_id, warp_id

using namespace jax_ep;

constexpr int kMaxGpus = 8, kWarm = 3, kReps = 10, kSmWarps = 16, kUnroll = 8, kMaxStages = 16;
constexpr int kRingBytes = 200 * 1024;

// Push methods: p[i] = this sender's slot in peer i's receive buffer (q unused). Pull methods: p[i] = peer i's
// source rows, q[i] = peer i's slot in this GPU's receive buffer.
struct Dsts {
  char* p[kMaxGpus - 1];
  char* q[kMaxGpus - 1];
  int n;
};

// d.p[i] / d.q[i] for a runtime i, by unrolled select (a dynamic index into a kernel parameter array would copy it to
// local memory).
__device__ __forceinline__ void peer_pair(const Dsts& d, int i, const char** from, char** to) {
#pragma unroll
  for (int k = 0; k < kMaxGpus - 1; ++k)
    if (k == i) {
      *from = d.p[k];
      *to = d.q[k];
    }
}

// One warp's chunk `base` of a row: up to kUnroll 16-byte vectors per lane, all loads in flight before any store.
__device__ __forceinline__ void load_chunk(const int4* s, int base, int n16, int4* v) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (base + j * 32 + lane_id() < n16) v[j] = ld_nc_v4(s + base + j * 32 + lane_id());
}
__device__ __forceinline__ void store_chunk(int4* t, int base, int n16, const int4* v) {
#pragma unroll
  for (int j = 0; j < kUnroll; ++j)
    if (base + j * 32 + lane_id() < n16) st_v4(t + base + j * 32 + lane_id(), v[j]);
}

// Rows of block b: b + B * k, k = 0, 1, ...; its warp w takes those with k % warps == w.
__global__ void __launch_bounds__(512) sm_stores(const char* src, Dsts d, int rows, int row_bytes, int) {
  const int n16 = row_bytes / 16;
  for (int r = blockIdx.x + gridDim.x * warp_id(); r < rows; r += gridDim.x * kSmWarps) {
    const int4* s = reinterpret_cast<const int4*>(src + static_cast<int64_t>(r) * row_bytes);
    for (int base = 0; base < n16; base += 32 * kUnroll) {
      int4 v[kUnroll];
      load_chunk(s, base, n16, v);
#pragma unroll
      for (int p = 0; p < kMaxGpus - 1; ++p) {  // static indices: d stays in parameter space
        if (p >= d.n) break;
        store_chunk(reinterpret_cast<int4*>(d.p[p] + static_cast<int64_t>(r) * row_bytes), base, n16, v);
      }
    }
  }
}

// Pull: items (row, peer), peer fastest, one warp per item: 8 16-byte loads per lane from the peer in flight, then
// stores into this GPU's receive buffer.
__global__ void __launch_bounds__(512) sm_loads(const char*, Dsts d, int rows, int row_bytes, int) {
  const int n16 = row_bytes / 16;
  const int64_t items = static_cast<int64_t>(rows) * d.n;
  for (int64_t it = blockIdx.x + gridDim.x * warp_id(); it < items; it += gridDim.x * kSmWarps) {
    const int r = static_cast<int>(it / d.n), i = static_cast<int>(it % d.n);
    const char* from = nullptr;
    char* to = nullptr;
    peer_pair(d, i, &from, &to);
    const int4* s = reinterpret_cast<const int4*>(from + static_cast<int64_t>(r) * row_bytes);
    int4* t = reinterpret_cast<int4*>(to + static_cast<int64_t>(r) * row_bytes);
    for (int base = 0; base < n16; base += 32 * kUnroll) {
      int4 v[kUnroll];
      load_chunk(s, base, n16, v);
      store_chunk(t, base, n16, v);
    }
  }
}

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint64_t gmem(const void* p) { return static_cast<uint64_t>(__cvta_generic_to_global(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(b)) : "memory");
}
// The stage's one arrival per phase; the phase then completes when `bytes` of bulk loads have landed.
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(smem(b)), "r"(bytes)
               : "memory");
}
// Returns once phase `parity` of *b has completed (acquire, CTA scope: the loaded bytes are visible).
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(smem(b)), "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem(dst)),
               "l"(gmem(src)), "r"(bytes), "r"(smem(bar))
               : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem(dst)), "r"(smem(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// All but the newest N committed groups have finished reading their shared-memory sources (N: an immediate).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_read(int n) {
  switch (n) {
    case 1: bulk_wait_read<1>(); break;
    case 2: bulk_wait_read<2>(); break;
    case 3: bulk_wait_read<3>(); break;
    case 4: bulk_wait_read<4>(); break;
    case 5: bulk_wait_read<5>(); break;
    case 6: bulk_wait_read<6>(); break;
    case 7: bulk_wait_read<7>(); break;
    case 8: bulk_wait_read<8>(); break;
    default: bulk_wait_read<0>(); break;
  }
}

// kProducers warps per block; lane 0 of warp w runs its own ring of `stages` stages (2 to 16 / kProducers) and takes
// the block's rows b + B * k with k % kProducers == w. Row j of the ring sits in stage j % stages (phase j / stages).
// After row j's stores are committed as one group, wait_group.read lag (lag = stages / 2) frees the stage of row
// j - lag, which then loads row j - lag + stages: stages - lag rows of loads stay in flight ahead of the stores. The
// final wait_group 0 makes every store complete (written to the peer) before the kernel ends.
// kPull: the items are (row, peer) pairs, peer fastest; each is loaded from the peer's source (d.p) and stored once
// into this GPU's receive buffer (d.q).
template <int kProducers, int kChunk, bool kPull = false>
__global__ void __launch_bounds__(32 * kProducers) tma(const char* src, Dsts d, int rows, int row_bytes, int stages) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  if (lane_id() != 0) return;
  char* mine = ring + static_cast<int64_t>(warp_id()) * stages * row_bytes;
  uint64_t* bar = full + warp_id() * stages;
  for (int s = 0; s < stages; ++s) mbar_init(bar + s);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the inits before the bulk copies' complete_tx
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int items = kPull ? rows * d.n : rows;
  const int step = gridDim.x * kProducers, first = blockIdx.x + gridDim.x * warp_id();
  const int n = first < items ? (items - first + step - 1) / step : 0, lag = stages / 2;
  const int chunk = kChunk > 0 ? kChunk : row_bytes;
  auto item = [&](int j) { return first + j * step; };
  auto at = [&](int j) {  // byte offset of item j's row
    return static_cast<int64_t>(kPull ? item(j) / d.n : item(j)) * row_bytes;
  };
  auto load = [&](int j) {
    const int s = j % stages;
    const char* from = src;
    if (kPull) {
      char* unused = nullptr;
      peer_pair(d, item(j) % d.n, &from, &unused);
    }
    mbar_expect(bar + s, row_bytes);
    bulk_load(mine + static_cast<int64_t>(s) * row_bytes, from + at(j), row_bytes, bar + s);
  };
  for (int j = 0; j < min(stages, n); ++j) load(j);
  for (int j = 0; j < n; ++j) {
    const int s = j % stages;
    mbar_wait(bar + s, static_cast<uint32_t>(j / stages) & 1u);
    const char* stage = mine + static_cast<int64_t>(s) * row_bytes;
    if (kPull) {
      const char* unused = nullptr;
      char* to = nullptr;
      peer_pair(d, item(j) % d.n, &unused, &to);
      for (int off = 0; off < row_bytes; off += chunk)
        bulk_store(to + at(j) + off, stage + off, min(chunk, row_bytes - off));
    } else {
#pragma unroll
      for (int p = 0; p < kMaxGpus - 1; ++p) {
        if (p >= d.n) break;
        for (int off = 0; off < row_bytes; off += chunk)
          bulk_store(d.p[p] + at(j) + off, stage + off, min(chunk, row_bytes - off));
      }
    }
    bulk_commit();
    if (j >= lag) {
      bulk_wait_read(lag);
      if (j - lag + stages < n) load(j - lag + stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void fill(uint32_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = (static_cast<uint32_t>(i) * 2654435761u) ^ (seed * 0x9e3779b9u) ^ static_cast<uint32_t>(i >> 32);
}

static void ck(cudaError_t e, const char* what, int line) {
  if (e == cudaSuccess) return;
  fprintf(stderr, "peer_bandwidth: %s failed (line %d): %s\n", what, line, cudaGetErrorString(e));
  exit(2);
}
#define CK(x) ck((x), #x, __LINE__)

using Kernel = void (*)(const char*, Dsts, int, int, int);
struct Method {
  const char* name;
  Kernel k;
  int threads, producers;  // producers 0: no ring
  bool pull;               // each GPU reads its peers' rows (ingress) instead of writing into them (egress)
};

int main(int argc, char** argv) {
  const int rows = argc > 1 ? atoi(argv[1]) : 4096, row_bytes = argc > 2 ? atoi(argv[2]) : 14336;
  int G = 0;
  CK(cudaGetDeviceCount(&G));
  G = std::min(G, kMaxGpus);
  if (G < 2 || rows < 1 || row_bytes < 16 || row_bytes % 16 != 0) {
    fprintf(stderr, "peer_bandwidth: needs 2 to 8 GPUs (found %d), ROWS > 0, ROW_BYTES a multiple of 16\n", G);
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const int64_t slot = static_cast<int64_t>(rows) * row_bytes, egress = slot * (G - 1);
  std::vector<char*> src(G), recv(G);
  std::vector<cudaStream_t> stream(G);
  std::vector<cudaEvent_t> t0(G), t1(G);
  for (int g = 0; g < G; ++g) {
    CK(cudaSetDevice(g));
    for (int h = 0; h < G; ++h) {
      int ok = 0;
      if (h == g) continue;
      CK(cudaDeviceCanAccessPeer(&ok, g, h));
      if (!ok) { fprintf(stderr, "peer_bandwidth: GPU %d cannot access GPU %d\n", g, h); return 2; }
      CK(cudaDeviceEnablePeerAccess(h, 0));
    }
    CK(cudaMalloc(&src[g], slot));
    CK(cudaMalloc(&recv[g], slot * G));
    CK(cudaStreamCreateWithFlags(&stream[g], cudaStreamNonBlocking));
    CK(cudaEventCreate(&t0[g]));
    CK(cudaEventCreate(&t1[g]));
    fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(src[g]), slot / 4, 1000u + g);
    CK(cudaGetLastError());
  }
  std::vector<int> blocks;
  for (int b : {1, 2, 4, 8, 16, 24, 32, 64, 132})
    if (blocks.empty() || std::min(b, sms) > blocks.back()) blocks.push_back(std::min(b, sms));
  const Method methods[] = {{"sm_stores", sm_stores, 512, 0, false},
                            {"tma", tma<1, 0>, 32, 1, false},
                            {"tma_4warps", tma<4, 0>, 128, 4, false},
                            {"tma_4k", tma<1, 4096>, 32, 1, false},
                            {"pull: sm_loads", sm_loads, 512, 0, true},
                            {"pull: tma", tma<1, 0, true>, 32, 1, true},
                            {"pull: tma_4warps", tma<4, 0, true>, 128, 4, true}};
  printf("peer_bandwidth: %d GPUs (%s, %d SMs), %d rows of %d bytes per GPU, each to %d peers: %.1f MB egress per "
         "GPU per launch (pull: the same bytes read from the peers); GB/s per GPU, median of %d launches of the "
         "slowest GPU\n",
         G, prop.name, sms, rows, row_bytes, G - 1, egress / 1e6, kReps);
  printf("| method |");
  for (int b : blocks) printf(" B=%d |", b);
  printf("\n|---|");
  for (size_t i = 0; i < blocks.size(); ++i) printf("---|");
  printf("\n");
  std::vector<std::string> mismatches;  // printed after the table
  for (const Method& m : methods) {
    const int stages = m.producers ? std::min(kMaxStages, kRingBytes / row_bytes) / m.producers : 0;
    const int smem_bytes = stages * m.producers * row_bytes;
    printf("| %s |", m.name);
    if (m.producers && stages < 2) {  // a ring needs two stages per producer
      for (size_t i = 0; i < blocks.size(); ++i) printf(" n/a |");
      printf("\n");
      continue;
    }
    for (int g = 0; g < G; ++g) {
      CK(cudaSetDevice(g));
      if (smem_bytes > 0)
        CK(cudaFuncSetAttribute(reinterpret_cast<const void*>(m.k), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                smem_bytes));
      CK(cudaMemset(recv[g], 0, slot * G));
      CK(cudaDeviceSynchronize());
    }
    for (int B : blocks) {
      std::vector<float> ms;
      for (int rep = 0; rep < kWarm + kReps; ++rep) {
        for (int g = 0; g < G; ++g) {
          Dsts d{};
          for (int h = 0; h < G; ++h) {
            if (h == g) continue;
            d.p[d.n] = m.pull ? src[h] : recv[h] + slot * g;
            d.q[d.n++] = m.pull ? recv[g] + slot * h : nullptr;
          }
          CK(cudaSetDevice(g));
          CK(cudaEventRecord(t0[g], stream[g]));
          m.k<<<B, m.threads, smem_bytes, stream[g]>>>(src[g], d, rows, row_bytes, stages);
          CK(cudaGetLastError());
          CK(cudaEventRecord(t1[g], stream[g]));
        }
        float worst = 0.f;
        for (int g = 0; g < G; ++g) {
          float t = 0.f;
          CK(cudaEventSynchronize(t1[g]));
          CK(cudaEventElapsedTime(&t, t0[g], t1[g]));
          worst = std::max(worst, t);
        }
        if (rep >= kWarm) ms.push_back(worst);
      }
      std::sort(ms.begin(), ms.end());
      const double med = 0.5 * (ms[kReps / 2 - 1] + ms[kReps / 2]);
      printf(" %.1f |", egress / (med * 1e-3) / 1e9);
      fflush(stdout);
    }
    printf("\n");
    // Sampled rows of every slot, after the last launch: all of them were written by every launch.
    std::vector<char> want(row_bytes), got(row_bytes);
    const int sample[] = {0, 1, rows / 3, rows / 2, rows - 1};
    for (int r = 0; r < G; ++r)
      for (int s = 0; s < G; ++s)
        for (int row : sample) {
          if (s == r) continue;
          CK(cudaMemcpy(want.data(), src[s] + static_cast<int64_t>(row) * row_bytes, row_bytes, cudaMemcpyDefault));
          CK(cudaMemcpy(got.data(), recv[r] + slot * s + static_cast<int64_t>(row) * row_bytes, row_bytes,
                        cudaMemcpyDefault));
          if (memcmp(want.data(), got.data(), row_bytes) != 0) {
            char line[160];
            snprintf(line, sizeof(line), "peer_bandwidth: %s: MISMATCH in row %d of sender %d's slot on GPU %d",
                     m.name, row, s, r);
            mismatches.push_back(line);
          }
        }
  }
  for (const std::string& line : mismatches) printf("%s\n", line.c_str());
  if (mismatches.empty()) printf("peer_bandwidth: data OK\n");
  return mismatches.empty() ? 0 : 1;
}
