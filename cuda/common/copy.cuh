// Warp-wide copies of 16-byte vectors and bf16 unpacking, shared by the kernels.
#pragma once

#include <cuda_bf16.h>

#include "common/ptx.cuh"
#include "common/thread.cuh"

namespace jax_ep {

// Eight bf16 values (one 16-byte vector) as floats.
__device__ __forceinline__ void unpack_bf16x8(const int4& v, float f[8]) {
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h2[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// acc[i] = fmaf(w, bf16 value i of v, acc[i]) for the eight values of one 16-byte vector: the weighted sum of the
// low-latency combines (one fused multiply-add per term, in the caller's term order: docs/SPEC.md).
__device__ __forceinline__ void fma_bf16x8(float acc[8], float w, const int4& v) {
  float f[8];
  unpack_bf16x8(v, f);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, f[i], acc[i]);
}

// Eight floats as one 16-byte vector of bf16 (round to nearest even).
__device__ __forceinline__ int4 pack_bf16x8(const float f[8]) {
  int4 v;
  __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h2[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// One warp copies `bytes` (a multiple of 16) of peer-written data: L1-bypassing loads (ld.cg), four per lane in
// flight before their stores (a load-store chain per vector would serialize the NVLink or HBM round trips).
__device__ __forceinline__ void copy_segment_cg(char* dst, const char* src, int bytes) {
  const int n16 = bytes / 16;
  for (int base = 0; base < n16; base += 4 * 32) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = base + u * 32 + lane_id();
      if (j < n16) v[u] = ld_cg_v4(reinterpret_cast<const int4*>(src) + j);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int j = base + u * 32 + lane_id();
      if (j < n16) st_v4(reinterpret_cast<int4*>(dst) + j, v[u]);
    }
  }
}

// One warp's share of a segment of peer-written data (at most 2048 bytes, a multiple of 16): lane l holds vectors
// l, l + 32, l + 64, l + 96, loaded L1-bypassing (ld.cg), all four in flight at once. store_segment writes them to
// one destination; a segment loaded once can be stored to several.
__device__ __forceinline__ void load_segment_cg(const char* src, int bytes, int4 v[4]) {
  const int n16 = bytes / 16;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = u * 32 + lane_id();
    if (j < n16) v[u] = ld_cg_v4(reinterpret_cast<const int4*>(src) + j);
  }
}

__device__ __forceinline__ void store_segment(char* dst, int bytes, const int4 v[4]) {
  const int n16 = bytes / 16;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = u * 32 + lane_id();
    if (j < n16) st_v4(reinterpret_cast<int4*>(dst) + j, v[u]);
  }
}

// One warp copies at most 2048 bytes (4 vectors per lane) of read-only input: every load issued before any store.
__device__ __forceinline__ void copy_segment_nc(char* dst, const char* src, int bytes) {
  const int n16 = bytes / 16;
  int4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = u * 32 + lane_id();
    if (j < n16) v[u] = ld_nc_v4(reinterpret_cast<const int4*>(src) + j);
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = u * 32 + lane_id();
    if (j < n16) st_v4(reinterpret_cast<int4*>(dst) + j, v[u]);
  }
}

}  // namespace jax_ep
