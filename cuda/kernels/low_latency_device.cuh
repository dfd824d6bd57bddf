// Device helpers shared by the low-latency kernels of both modes (low_latency_kernels.cu: per_expert,
// low_latency_per_rank_kernels.cu: per_rank): launch shapes, the fp8 quantizer of SPEC §4, token slots and positions
// (the last-block tickets: common/last_block.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/copy.cuh"
#include "common/last_block.cuh"
#include "common/ptx.cuh"
#include "common/source_of_row.cuh"
#include "common/thread.cuh"
#include "jax_ep/api.h"
#include "jax_ep/low_latency_params.h"
#include "jax_ep/layout_params.h"
#include "jax_ep/staging_layout.h"

namespace jax_ep::low_latency {

constexpr int kSendThreads = 512;      // dispatch send: 16 warps per token
constexpr int kThreads = 512;          // dispatch recv, combine send
constexpr int kCombineRecvThreads = 256;
// Kernels that wait for, count or signal every rank give rank s to thread s of a block: one thread per rank.
static_assert(kSendThreads >= kMaxGroupRanks && kThreads >= kMaxGroupRanks && kCombineRecvThreads >= kMaxGroupRanks,
              "a low-latency block has one thread per rank of the largest group");
constexpr int kTermsInFlight = 8;      // combine receives: loads of this many terms of a sum issued before its adds
constexpr int kSegBytes = 2048;        // one warp work item: 128 x 16-byte vectors (4 per lane)
constexpr int kSegChannels = 1024;     // dispatch send work item: 1024 channels (= kSegBytes of bf16)
constexpr float kInvE4m3Max = static_cast<float>(1.0 / 448.0);  // f32(1/448): the SPEC §4 rule as written
constexpr uint32_t kE4m3NaN = 0x7Fu;   // the e4m3fn NaN code a non-finite channel becomes (jax_ep/fp8.py)
// Shared memory of a block without an opt-in, static and dynamic together: the dispatch sends hold their own (under
// 3 KB) plus H + H/32 bytes of one quantized row, so fp8 H up to about 44800 fits.
constexpr int kMaxSendSharedBytes = 48 * 1024;

__device__ __forceinline__ bool is_finite(float f) { return fabsf(f) < __int_as_float(0x7f800000); }  // NaN: false

// f32 subnormals count as +-0 (jax_ep/fp8.py: XLA:CPU flushes them, GPUs do not; the rule fixes one answer).
constexpr float kMinNormal = 1.17549435e-38f;                 // 2^-126
constexpr float kMinAmax = 448.0f * 1.17549435e-38f;          // 7 * 2^-120: smaller amax -> scale 1
__device__ __forceinline__ float flush_subnormal(float f) { return fabsf(f) < kMinNormal ? copysignf(0.0f, f) : f; }

// Quantizes channels [ch0, ch1) (at most kSegChannels) of one bf16 row into an fp8 message (payload at +0, scales
// at +H). Each lane owns 16 channels per step (two 16-byte loads, one 16-byte fp8 store: NVLink moves full 16-byte
// stores about twice as fast as 8-byte ones); step j covers ch0 + 512 j + [0, 512), and each group of 8 lanes owns one
// 128-channel block (H % 128 == 0). All loads of the segment are issued before any arithmetic.
// warp_scales: 8 floats of shared memory owned by this warp (the segment's scales go to the peer as 16-byte vectors,
// not 4-byte writes).
// Non-finite channels (docs/API.md, jax_ep/fp8.py): amax is taken over the block's finite channels only (0 if none),
// and every NaN / +inf / -inf channel is stored as the NaN code 0x7F (not a saturated 448), so NaN propagates to
// exactly the channels that were non-finite and the rest of the block is quantized as if they were absent.
__device__ __forceinline__ void quantize_segment(char* msg_payload, const __nv_bfloat16* row, int hidden, int ch0,
                                                 int ch1, float* warp_scales) {
  constexpr int kSteps = kSegChannels / 512;
  const int lane = lane_id();
  int4 v[kSteps][2];
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const int ch = ch0 + 512 * j + lane * 16;
    if (ch < ch1) {
      v[j][0] = ld_nc_v4(reinterpret_cast<const int4*>(row + ch));
      v[j][1] = ld_nc_v4(reinterpret_cast<const int4*>(row + ch + 8));
    }
  }
  float amax[kSteps];
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    amax[j] = 0.0f;
    if (ch0 + 512 * j + lane * 16 < ch1) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float f[8];
        unpack_bf16x8(v[j][h], f);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax[j] = fmaxf(amax[j], is_finite(f[i]) ? fabsf(flush_subnormal(f[i])) : 0.0f);
      }
    }
  }
#pragma unroll
  for (int o = 4; o >= 1; o >>= 1) {
#pragma unroll
    for (int j = 0; j < kSteps; ++j) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], o));
  }
#pragma unroll
  for (int j = 0; j < kSteps; ++j) {
    const int ch = ch0 + 512 * j + lane * 16;
    if (ch >= ch1) continue;
    // SPEC §4 / jax_ep/fp8.py: scale = amax * f32(1/448), q = e4m3(x * (1 / scale)); amax < 448 * 2^-126
    // (zero or tiny blocks, whose scale would be subnormal): scale 1.
    const float scale = amax[j] >= kMinAmax ? __fmul_rn(amax[j], kInvE4m3Max) : 1.0f;
    const float inv = __fdiv_rn(1.0f, scale);
    uint32_t q2[8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float f[8];
      unpack_bf16x8(v[j][h], f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = flush_subnormal(f[i]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t pair = __nv_cvt_float2_to_fp8x2(  // f[2i] -> low byte, f[2i+1] -> high byte
            make_float2(__fmul_rn(f[2 * i], inv), __fmul_rn(f[2 * i + 1], inv)), __NV_SATFINITE, __NV_E4M3);
        if (!is_finite(f[2 * i])) pair = (pair & 0xFF00u) | kE4m3NaN;
        if (!is_finite(f[2 * i + 1])) pair = (pair & 0x00FFu) | (kE4m3NaN << 8);
        q2[4 * h + i] = pair;
      }
    }
    st_v4(reinterpret_cast<int4*>(msg_payload + ch),
          make_int4(static_cast<int>(q2[0] | (q2[1] << 16)), static_cast<int>(q2[2] | (q2[3] << 16)),
                    static_cast<int>(q2[4] | (q2[5] << 16)), static_cast<int>(q2[6] | (q2[7] << 16))));
    if ((lane & 7) == 0) warp_scales[(ch - ch0) / kFp8Block] = scale;
  }
  __syncwarp();
  const int blocks = (ch1 - ch0) / kFp8Block;  // <= 8 scales of this segment, contiguous in the message
  float* dst = reinterpret_cast<float*>(msg_payload + hidden) + ch0 / kFp8Block;
  if (blocks % 4 == 0) {
    if (lane < blocks / 4) reinterpret_cast<float4*>(dst)[lane] = reinterpret_cast<const float4*>(warp_scales)[lane];
  } else if (lane < blocks) {
    dst[lane] = warp_scales[lane];
  }
  __syncwarp();  // warp_scales is reused by the warp's next item
}

// off[0..R]: exclusive prefix offsets of an expert's packed rows per source rank, from its row of the handle's
// layout_range (rows per source, clamped to [0, T_max] so a corrupted handle never indexes out of bounds).
__device__ __forceinline__ void source_offsets(int32_t* off, const int32_t* layout_range_row, int R, int Tm) {
  off[0] = 0;
  for (int s = 0; s < R; ++s) off[s + 1] = off[s] + min(max(__ldg(layout_range_row + s), 0), Tm);
}

// The distinct destinations of token t and its position at each: destination of slot k = expert e_k / div (div 1:
// the expert, per_expert mode; div L: its rank, per_rank mode). s_dest[k] = that destination for the first k naming
// it (-1 for an invalid id or a repeat); s_pos[k] = tokens t' < t with at least one valid id of that destination.
// kExpertPositions (per_rank mode): also s_epos[k] = tokens t' < t naming the expert of slot k, for every valid slot
// (a repeated expert gets the position of its first slot), -1 for an invalid id: the row the expert's receiver
// gives token t among this source's rows. s_part / s_epart: [num_warps][kMaxTopk] of shared memory.
// All threads; ends with __syncthreads.
static_assert(kSendThreads >= 32 + kMaxTopk, "token_slots<true>: warp 1 sums the expert positions of K slots");
template <bool kExpertPositions = false>
__device__ __forceinline__ void token_slots(const int32_t* topk_idx, int t, int K, int E, int div, int32_t* s_dest,
                                           int32_t* s_pos, int32_t (*s_part)[kMaxTopk], int32_t* s_epos = nullptr,
                                           int32_t (*s_epart)[kMaxTopk] = nullptr) {
  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id();
  const int32_t* ids = topk_idx + static_cast<int64_t>(t) * K;
  auto dest = [&](int32_t e) { return layout::valid_expert(e, E) ? e / div : -1; };
  auto expert = [&](int32_t e) { return layout::valid_expert(e, E) ? e : -1; };
  if (tid < K) {
    const int32_t d = dest(__ldg(ids + tid));
    bool first = d >= 0;
    for (int j = 0; j < tid; ++j) first &= (dest(__ldg(ids + j)) != d);  // a repeat gets no message of its own
    s_dest[tid] = first ? d : -1;
  }
  // s_epos holds the slots' experts until the positions replace them (the compares below read one slot's at a time
  // from shared memory, beside the earlier token's destinations and experts in registers).
  if (kExpertPositions && tid < K) s_epos[tid] = expert(__ldg(ids + tid));
  __syncthreads();
  auto mine = [&](int k) { return k < K ? s_dest[k] : -1; };
  auto mine_e = [&](int k) { return k < K ? s_epos[k] : -1; };
  // Per warp, tokens counted by ballots: s_part[warp][k] (s_epart: experts), written by the warp's lane 0 only.
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      s_part[warp][k] = 0;
      if (kExpertPositions) s_epart[warp][k] = 0;
    }
  }
  // Earlier tokens, one per thread. The loop's trip count is block-uniform; a warp none of whose lanes has an earlier
  // token skips the pass (its s_part row stays 0), and the slot loops stop at K (warp-uniform), so the cost follows
  // the tokens and K actually present rather than blockDim.x and kMaxTopk.
  for (int tp0 = 0; tp0 < t; tp0 += blockDim.x) {
    if (tp0 + warp * 32 >= t) continue;  // warp-uniform; no barrier inside the loop
    const int tp = tp0 + tid;
    int32_t id[kMaxTopk];  // the earlier token's ids as given (-1 past K and for threads without a token)
#pragma unroll
    for (int j = 0; j < kMaxTopk; ++j)
      id[j] = tp < t && j < K ? __ldg(topk_idx + static_cast<int64_t>(tp) * K + j) : -1;
    // slot by slot: this token's destination (expert) read once from shared memory and compared with the earlier
    // token's K ids, counted once per earlier token however often it names it. Destination d owns the experts
    // [d * div, (d + 1) * div), all valid, so a range test replaces dividing each id (an invalid id, negative or
    // >= E, is in no valid destination's range and equals no valid expert).
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      if (k >= K) break;  // warp-uniform
      const int32_t md = mine(k);
      const int32_t lo = md >= 0 ? md * div : 1, hi = md >= 0 ? lo + div : 0;  // empty range for no destination
      bool hit = false;
#pragma unroll
      for (int j = 0; j < kMaxTopk; ++j) {
        if (j >= K) break;  // id[j] is -1 from K on
        hit |= id[j] >= lo && id[j] < hi;
      }
      const int c = __popc(__ballot_sync(0xffffffffu, hit));
      int ce = 0;
      if (kExpertPositions) {
        const int32_t me_k = mine_e(k);
        bool ehit = false;
#pragma unroll
        for (int j = 0; j < kMaxTopk; ++j) {
          if (j >= K) break;
          ehit |= me_k >= 0 && id[j] == me_k;
        }
        ce = __popc(__ballot_sync(0xffffffffu, ehit));
      }
      if (lane == 0) {
        s_part[warp][k] += c;
        if (kExpertPositions) s_epart[warp][k] += ce;
      }
    }
  }
  __syncthreads();
  if (tid < K) {
    int32_t pos = 0;
    for (int w = 0; w < num_warps(); ++w) pos += s_part[w][tid];
    s_pos[tid] = pos;
  } else if (kExpertPositions && tid >= 32 && tid < 32 + K) {  // another warp: the two sums run side by side
    const int k = tid - 32;
    int32_t pos = 0;
    for (int w = 0; w < num_warps(); ++w) pos += s_epart[w][k];
    s_epos[k] = s_epos[k] >= 0 ? pos : -1;  // only this thread touches s_epos[k] after the loop
  }
  __syncthreads();
}

// One warp copies `bytes` (a multiple of 4, at most kSegBytes) from shared memory to a peer: 16-byte vectors, then
// 4-byte words for the tail (an fp8 message's scales are H/32 bytes: not always a multiple of 16).
__device__ __forceinline__ void copy_segment_from_shared(char* dst, const char* src, int bytes) {
  const int n16 = bytes / 16;
  for (int j = lane_id(); j < n16; j += 32)
    st_v4(reinterpret_cast<int4*>(dst) + j, reinterpret_cast<const int4*>(src)[j]);
  for (int j = n16 * 4 + lane_id(); j < bytes / 4; j += 32)
    reinterpret_cast<int32_t*>(dst)[j] = reinterpret_cast<const int32_t*>(src)[j];
}

// Exclusive prefix sums, in place, of v[0..n) in shared memory (n <= 2 * blockDim.x, blockDim.x a multiple of 32):
// thread i owns v[2i] and v[2i + 1]; warp scans by shuffles, then one scan of the warp totals (s_warp: 32 ints of
// shared memory). Returns the total in every thread. All threads; ends with __syncthreads.
__device__ __forceinline__ int32_t block_exclusive_scan(int32_t* v, int n, int32_t* s_warp) {
  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id();
  __syncthreads();  // v is complete
  const int32_t a = 2 * tid < n ? v[2 * tid] : 0, b = 2 * tid + 1 < n ? v[2 * tid + 1] : 0;
  int32_t x = a + b;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < num_warps() ? s_warp[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    s_warp[lane] = w;  // inclusive totals of warps 0..lane
  }
  __syncthreads();
  const int32_t base = (warp > 0 ? s_warp[warp - 1] : 0) + x - (a + b);
  if (2 * tid < n) v[2 * tid] = base;
  if (2 * tid + 1 < n) v[2 * tid + 1] = base + a;
  const int32_t total = s_warp[num_warps() - 1];
  __syncthreads();
  return total;
}

// ---- launch shapes (per_expert kernels of both transports) ----
inline int sm_count_or_default(const Ctx& c) { return c.sm_count > 0 ? c.sm_count : 132; }

// Dispatch send: one block per token, at most two per SM (T = 0: one block).
inline int send_grid(const DispatchSendParams& p) {
  return std::max(1, std::min(p.num_tokens, 2 * sm_count_or_default(p.c)));
}

// Kernels with blocks (local expert, part), launched with kExpertBlocksPerSm blocks per SM resident (their
// __launch_bounds__ say so): as many parts as fit in ONE wave (at least 1). A second wave pays every block's fixed
// cost (open, the signal wait, fences) twice on the critical path: rounding up (288 blocks for L=144 on 132 SMs)
// made both LL receive kernels two waves at EP2.
constexpr int kExpertBlocksPerSm = 2;
inline dim3 expert_grid(const Ctx& c, int max_parts = 16) {
  const int parts = std::max(1, std::min(max_parts, kExpertBlocksPerSm * sm_count_or_default(c) / c.num_local));
  return dim3(c.num_local, parts);
}

// Blocks of a kThreads-thread kernel whose warps share `items` work items over the whole grid: one item per warp, at
// most one wave of kExpertBlocksPerSm blocks per SM (such kernels may spin on peers' flags: see combine_recv_grid).
inline int one_wave_blocks(const Ctx& c, int64_t items) {
  const int64_t blocks = (items + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, kExpertBlocksPerSm * sm_count_or_default(c))));
}

// Combine send (per_expert): (row, segment) items, the rows of every local expert, at most R * T_max each, and at
// most R * T * min(K, L) in all (each source's T tokens reach at most min(K, L) experts here; every rank calls with
// the same T). The grid only sets the parallelism (the body strides over the items), so a small call has few blocks.
inline int combine_send_blocks(const CombineSendParams& p) {
  const int64_t L = p.c.num_local, R = p.c.g.num_ranks, nseg = (2 * p.c.hidden + kSegBytes - 1) / kSegBytes;
  const int64_t rows = std::min(L * R * p.c.max_tokens, R * p.num_tokens * std::min<int64_t>(p.num_topk, L));
  return one_wave_blocks(p.c, std::max<int64_t>(rows, 1) * nseg);
}

// Combine receive: blocks (token, part) of `threads` threads, parts splitting H/8 vectors over a token's blocks.
// INVARIANT (no starvation): its blocks spin on peers' flags, so the grid never exceeds one wave of
// kExpertBlocksPerSm blocks per SM (resident, and leaving room for other streams' kernels); blocks walk the tokens
// t = x, x + blocks, ... (BlockPlace). In a fused kernel these are the receive places beside the send's, and
// progress rests on the role tickets instead (low_latency_protocol.cuh, fused_frame).
inline dim3 combine_recv_grid(const CombineRecvParams& p, int threads) {
  const int max_parts = std::max(1, (p.c.hidden / 8 + threads - 1) / threads);
  const int blocks = std::max(1, std::min(p.num_tokens, kExpertBlocksPerSm * sm_count_or_default(p.c)));
  const int parts = std::max(1, std::min(max_parts, (2 * sm_count_or_default(p.c) + blocks - 1) / blocks));
  return dim3(blocks, parts);
}

// The parameters of a fused combine kernel (both modes: send places, then receive places; fused_frame).
struct CombineFusedParams {
  CombineSendParams send;
  CombineRecvParams recv;  // its io is unused: the send's state and the op's decision serve both
  int32_t senders;         // send places (one_wave_blocks); then recv_tokens x (places / recv_tokens) receive places
  int32_t recv_tokens;     // combine_recv_grid(recv, kThreads).x
};

// Shared memory of a dispatch send kernel: an fp8 message payload (bf16 rows are copied from global memory).
inline int send_shared_bytes(bool use_fp8, int hidden) {
  return use_fp8 ? static_cast<int>(align_up(hidden + 4 * (hidden / kFp8Block), 16)) : 0;
}

inline Status launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(what) + " launch failed: " + cudaGetErrorString(e));
}

// static_smem: the kernel's own shared memory (cudaFuncAttributes::sharedSizeBytes); smem: its dynamic part.
inline Status check_send_shared(int static_smem, int smem, int hidden) {
  if (static_smem + smem <= kMaxSendSharedBytes) return Status::Ok();
  return Status::Error("low-latency dispatch send: hidden=" + std::to_string(hidden) + " needs " +
                       std::to_string(smem) + " bytes of shared memory for one fp8 row beside the kernel's " +
                       std::to_string(static_smem) + " (at most " + std::to_string(kMaxSendSharedBytes) +
                       " in all)");
}

// A kernel's static shared memory in bytes, or -1 when CUDA cannot say (then the launch reports the error).
inline int static_shared_bytes(const void* kernel) {
  cudaFuncAttributes a{};
  return cudaFuncGetAttributes(&a, kernel) == cudaSuccess ? static_cast<int>(a.sharedSizeBytes) : -1;
}

}  // namespace jax_ep::low_latency
