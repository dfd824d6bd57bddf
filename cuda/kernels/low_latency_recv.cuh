// The bodies of the two low-latency receive kernels (per_expert mode), shared by both transports: the NVLink
// kernels (low_latency_kernels.cu, PeerWait below) and the NVSHMEM kernels (nvshmem/device/low_latency.cu, counted signals).
// They differ only in how a receiver learns that data has landed, which the Wait policy says:
//   int32_t source_count(c, half, epoch, l, s)  dispatch: wait until source s's rows of local expert l are all here;
//                                               returns how many it sent
//   void expert_rows(c, half, epoch, e)         combine: wait until expert e's rows for this rank are all here
// Both are called by one thread each; the bodies order what follows with __syncthreads and read the data with ld.cg.
// b: the block's place among the receive's blocks (blocks (l, part), and (t, part) for combine).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/ptx.cuh"
#include "common/thread.cuh"
#include "jax_ep/low_latency_params.h"
#include "jax_ep/layout_params.h"
#include "kernels/low_latency_device.cuh"
#include "kernels/low_latency_protocol.cuh"
#include "transport/peer.cuh"

namespace jax_ep::low_latency {

// The NVLink path: single-writer flags holding the epoch (staging_layout.h); dispatch's carry the count with it.
struct PeerWait {
  __device__ __forceinline__ int32_t source_count(const Ctx& c, const char* half, uint32_t epoch, int l,
                                                  int s) const {
    const uint64_t* word = reinterpret_cast<const uint64_t*>(half + c.low_latency.d_flags) + l * c.g.num_ranks + s;
    return static_cast<int32_t>(static_cast<uint32_t>(
        wait_word_reached(word, epoch, c.g.timeout_ns, "low-latency dispatch receive", c.g.rank, s)));
  }
  __device__ __forceinline__ void expert_rows(const Ctx& c, char* half, uint32_t epoch, int e) const {
    wait_reached(header_word(half, c.low_latency.c_flags + 4 * e), epoch, c.g.timeout_ns, "low-latency combine receive",
                 c.g.rank, e / c.num_local);
  }
};

template <typename Wait>
__device__ __forceinline__ void dispatch_recv_body(const DispatchRecvParams& p, uint32_t epoch, const Wait& wait,
                                                   const BlockPlace& b) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, H = c.hidden, Tm = c.max_tokens, rows_per_expert = R * Tm;
  const int l = b.x, part = b.y, parts = b.ny, tid = threadIdx.x;
  const char* half = self_base(g) + half_offset(c.low_latency, epoch);
  __shared__ int32_t s_off[kMaxGroupRanks + 1];
  __shared__ int32_t s_count[kMaxGroupRanks];
  if (tid < R) {
    const int32_t n = wait.source_count(c, half, epoch, l, tid);
    s_count[tid] = min(max(n, 0), Tm);  // never trust a count beyond the slots
  }
  __syncthreads();
  if (tid == 0) {
    s_off[0] = 0;
    for (int s = 0; s < R; ++s) s_off[s + 1] = s_off[s] + s_count[s];
  }
  __syncthreads();
  const int total = s_off[R];
  if (part == 0) {
    if (tid < R) p.layout_range[l * R + tid] = s_count[tid];
    if (tid == 0) p.recv_count[l] = total;
  }
  const char* expert_msgs = half + c.low_latency.rows + static_cast<int64_t>(l) * R * Tm * c.low_latency.msg_stride;
  auto message = [&](int i) {
    const int s = source_of_row(s_off, R, i);
    return expert_msgs + static_cast<int64_t>(s * Tm + (i - s_off[s])) * c.low_latency.msg_stride;
  };
  for (int i = part * blockDim.x + tid; i < rows_per_expert; i += parts * blockDim.x) {
    p.src_info[static_cast<int64_t>(l) * rows_per_expert + i] =
        i < total ? __ldcg(reinterpret_cast<const int32_t*>(message(i))) : -1;
  }
  const int payload_bytes = p.use_fp8 ? H : 2 * H;
  const int nseg = (payload_bytes + kSegBytes - 1) / kSegBytes;
  char* out = static_cast<char*>(p.recv_x) + static_cast<int64_t>(l) * rows_per_expert * payload_bytes;
  for (int item = part * num_warps() + warp_id(); item < total * nseg; item += parts * num_warps()) {
    const int i = item / nseg, seg = item % nseg;
    const int off = seg * kSegBytes;
    copy_segment_cg(out + static_cast<int64_t>(i) * payload_bytes + off, message(i) + kLowLatencyMsgHeader + off,
                    min(kSegBytes, payload_bytes - off));
  }
  if (p.use_fp8) {
    const int S = H / kFp8Block;
    float* scales = p.recv_x_scales + static_cast<int64_t>(l) * rows_per_expert * S;
    for (int idx = part * blockDim.x + tid; idx < total * S; idx += parts * blockDim.x) {
      const int i = idx / S, j = idx % S;
      scales[static_cast<int64_t>(i) * S + j] =
          __ldcg(reinterpret_cast<const float*>(message(i) + kLowLatencyMsgHeader + H) + j);
    }
  }
}

template <typename Wait>
__device__ __forceinline__ void combine_recv_body(const CombineRecvParams& p, uint32_t epoch, const Wait& wait,
                                                  const BlockPlace& b) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int E = c.num_experts, H = c.hidden, Tm = c.max_tokens, K = p.num_topk;
  const int part = b.y, parts = b.ny, tid = threadIdx.x;
  char* half = self_base(g) + half_offset(c.low_latency, epoch);
  __shared__ int32_t s_expert[kMaxTopk];
  __shared__ float s_weight[kMaxTopk];
  const char* rows = half + c.low_latency.rows;
  // T = 0 runs no iteration; the frame's finish_recv still publishes the epoch.
  for (int t = b.x; t < p.num_tokens; t += b.nx) {
    __syncthreads();  // the previous token's readers of s_expert / s_weight are done
    if (tid < K) {
      const int32_t e = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + tid);
      const bool valid = layout::valid_expert(e, E);
      if (valid) wait.expert_rows(c, half, epoch, e);
      // NOTE: the weight of a -1 / out-of-range slot is never loaded nor multiplied (the slot is skipped below), so
      // a NaN or inf weight there cannot reach y (0 * NaN = NaN would).
      s_expert[tid] = valid ? e : -1;
      s_weight[tid] = valid ? __ldg(p.topk_weights + static_cast<int64_t>(t) * K + tid) : 0.0f;
    }
    __syncthreads();
    for (int ci = part * blockDim.x + tid; ci < H / 8; ci += parts * blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < K; k0 += kTermsInFlight) {  // the chunk's loads in flight, then its FMAs in k order
        int4 v[kTermsInFlight];
#pragma unroll
        for (int u = 0; u < kTermsInFlight; ++u) {
          const int e = k0 + u < K ? s_expert[k0 + u] : -1;
          if (e >= 0) v[u] = ld_cg_v4(reinterpret_cast<const int4*>(rows + (static_cast<int64_t>(e) * Tm + t) * 2 * H) + ci);
        }
#pragma unroll
        for (int u = 0; u < kTermsInFlight; ++u)
          if (k0 + u < K && s_expert[k0 + u] >= 0) fma_bf16x8(acc, s_weight[k0 + u], v[u]);
      }
      const int4 o = pack_bf16x8(acc);
      reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(p.y) + static_cast<int64_t>(t) * H)[ci] = o;
    }
  }
}

}  // namespace jax_ep::low_latency
