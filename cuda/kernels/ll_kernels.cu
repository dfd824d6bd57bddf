// Low-latency mode (SPEC §4): dispatch into per-expert slots and weighted combine, each as a send kernel and a
// receive kernel (the two halves of the split custom calls; the fused op runs both back to back).
//
//   dispatch send   one block per token t: finds its distinct experts and its position among the tokens naming each
//                   (token order), reads the row once (fp8: quantized once, per 128 channels) and writes one message
//                   per expert into the owner at slot [l][me][position]; the last block publishes every expert's
//                   count and (l, me) flag. No count exchange, no barrier: positions are known locally, so the send
//                   never waits for a peer (except the rare "peer still reads op n-2" check).
//   dispatch recv   blocks (l, part): wait for the R flags of expert l, pack rows in (source, token) order into the
//                   XLA outputs, then the last block tells every peer "I consumed epoch n".
//   combine send    blocks (l, part): every valid row of expert l back to its source rank, slot [global e][token];
//                   the last block of expert l raises the c_flags[e] of every rank.
//   combine recv    blocks (t, part): wait for the flags of t's experts, y[t] = sum_k w[t, k] * row(e_k, t) in f32.
//
// Every kernel: open (read the chain state / token, decide) -> body (only when the op works) -> finish (the last block
// writes the output state): ll_protocol.cuh, ll_params.h. A skipped op waits for nothing and writes to no peer.
// Epochs, halves and single-writer flags: see cuda/include/jax_ep/staging_layout.h. Memory ordering as in
// transport/peer.cuh: peer stores -> __syncthreads -> __threadfence_system -> st.release.sys of the flag; the reader
// spins with ld.acquire.sys, then __syncthreads, then reads peer-written data with ld.cg (L1 is not coherent with
// peer stores).
// NOTE: the receive kernels spin inside their (at most ~2 x SMs) blocks instead of in a separate one-warp kernel:
// for latency, one kernel launch less. They only wait for send kernels that were queued before them on every GPU,
// and they leave most of each SM's thread slots free, so other streams can still make progress.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/copy.cuh"
#include "common/preload.cuh"
#include "common/ptx.cuh"
#include "common/thread.cuh"
#include "jax_ep/api.h"
#include "jax_ep/routing_params.h"
#include "kernels/ll_protocol.cuh"
#include "transport/peer.cuh"

namespace jax_ep::ll {
namespace {

constexpr int kSendThreads = 512;      // dispatch send: 16 warps per token
constexpr int kThreads = 512;          // dispatch recv, combine send
constexpr int kCombineRecvThreads = 256;
constexpr int kSegBytes = 2048;        // one warp work item: 128 x 16-byte vectors (4 per lane)
constexpr int kSegChannels = 1024;     // dispatch send work item: 1024 channels (= kSegBytes of bf16)
constexpr float kInvE4m3Max = static_cast<float>(1.0 / 448.0);  // f32(1/448): the SPEC §4 rule as written
constexpr uint32_t kE4m3NaN = 0x7Fu;
constexpr int kMaxSendSharedBytes = 48 * 1024;  // dynamic shared memory without an opt-in: fp8 H <= 47662   // the e4m3fn NaN code a non-finite channel becomes (jax_ep/fp8.py)

__device__ __forceinline__ bool is_finite(float f) { return fabsf(f) < __int_as_float(0x7f800000); }  // NaN: false

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
        for (int i = 0; i < 8; ++i) amax[j] = fmaxf(amax[j], is_finite(f[i]) ? fabsf(f[i]) : 0.0f);
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
    // SPEC §4 / jax_ep/fp8.py: scale = amax * f32(1/448), q = e4m3(x * (1 / scale)); amax == 0: scale 1.
    const float scale = amax[j] > 0.0f ? __fmul_rn(amax[j], kInvE4m3Max) : 1.0f;
    const float inv = __fdiv_rn(1.0f, scale);
    uint32_t q2[8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float f[8];
      unpack_bf16x8(v[j][h], f);
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

// Source rank of packed row i of an expert, from the exclusive prefix offsets off[0..R] (R <= 8).
__device__ __forceinline__ int source_of_row(const int32_t* off, int R, int i) {
  int s = 0;
  while (s + 1 < R && i >= off[s + 1]) ++s;
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch send, token-major: block b takes tokens b, b + grid, ... For each token it finds its distinct valid
// experts (slot k: the first k naming e), their positions (tokens before it naming e: the order the receiver packs),
// reads the row ONCE (fp8: quantizes it once into shared memory) and writes one message per expert into the owner's
// slot [l][me][position]. Per-expert counts are summed in this rank's LL scratch words (atomics); the last block
// to finish publishes every expert's count and flag (its threads in parallel) and resets the counters.
// NOTE (why token-major): expert-major blocks re-read and re-quantize a token's row once per expert and need E
// blocks (three waves at E=288); here the work is T rows, one block per token, and the quantization runs once.

// Distinct valid experts of token t (s_expert[k] = e, or -1 for an invalid or repeated id) and their positions
// (s_pos[k] = tokens t' < t naming s_expert[k]). All threads; ends with __syncthreads.
__device__ __forceinline__ void token_slots(const int32_t* topk_idx, int t, int K, int E, int32_t* s_expert,
                                           int32_t* s_pos, int32_t (*s_part)[kMaxTopk]) {
  const int tid = threadIdx.x, lane = lane_id(), warp = warp_id();
  const int32_t* ids = topk_idx + static_cast<int64_t>(t) * K;
  if (tid < K) {
    const int32_t e = __ldg(ids + tid);
    bool ok = routing::valid_expert(e, E);
    for (int j = 0; j < tid; ++j) ok &= (__ldg(ids + j) != e);  // a repeated expert gets one message (first k)
    s_expert[tid] = ok ? e : -1;
  }
  __syncthreads();
  int32_t mine[kMaxTopk];
  int32_t cnt[kMaxTopk];
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) {
    mine[k] = k < K ? s_expert[k] : -1;
    cnt[k] = 0;
  }
  for (int tp = tid; tp < t; tp += blockDim.x) {  // earlier tokens, one per thread
    const int32_t* other = topk_idx + static_cast<int64_t>(tp) * K;
    int32_t o[kMaxTopk];
#pragma unroll
    for (int j = 0; j < kMaxTopk; ++j) o[j] = j < K ? __ldg(other + j) : -2;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      bool hit = false;
#pragma unroll
      for (int j = 0; j < kMaxTopk; ++j) hit |= (o[j] == mine[k]);
      cnt[k] += (mine[k] >= 0 && hit) ? 1 : 0;  // once per earlier token, however often it repeats e
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) cnt[k] += __shfl_xor_sync(0xffffffffu, cnt[k], o);
    if (lane == 0) s_part[warp][k] = cnt[k];
  }
  __syncthreads();
  if (tid < K) {
    int32_t pos = 0;
    for (int w = 0; w < num_warps(); ++w) pos += s_part[w][tid];
    s_pos[tid] = pos;
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

__device__ __forceinline__ void dispatch_send_body(const DispatchSendParams& p, uint32_t epoch, char* s_row) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, E = c.num_experts, H = c.hidden, K = p.num_topk;
  const int T = p.num_tokens, warp = warp_id(), lane = lane_id(), nw = num_warps();
  const int64_t half = half_offset(c.ll, epoch);
  uint32_t* counts = reinterpret_cast<uint32_t*>(self_base(g) + c.ll.scratch);  // [E], zero between kernels
  __shared__ int32_t s_expert[kMaxTopk];
  __shared__ int32_t s_pos[kMaxTopk];
  __shared__ int32_t s_part[kSendThreads / 32][kMaxTopk];
  __shared__ __align__(16) float s_scales[kSendThreads / 32][kSegChannels / kFp8Block];
  if (threadIdx.x < R) wait_consumed(g, threadIdx.x, epoch);  // token_slots' first __syncthreads orders the rest
  const int payload_bytes = p.use_fp8 ? H + 4 * (H / kFp8Block) : 2 * H;  // fp8: q then the S scales
  const int nseg_in = (H + kSegChannels - 1) / kSegChannels;
  const int nseg_out = (payload_bytes + kSegBytes - 1) / kSegBytes;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    token_slots(p.topk_idx, t, K, E, s_expert, s_pos, s_part);
    if (threadIdx.x < K && s_expert[threadIdx.x] >= 0) atomicAdd(counts + s_expert[threadIdx.x], 1u);
    const __nv_bfloat16* row = reinterpret_cast<const __nv_bfloat16*>(p.x) + static_cast<int64_t>(t) * H;
    if (p.use_fp8) {  // quantize once into shared memory: [H fp8 | S f32], the message payload as it goes out
      for (int seg = warp; seg < nseg_in; seg += nw)
        quantize_segment(s_row, row, H, seg * kSegChannels, min(H, (seg + 1) * kSegChannels), s_scales[warp]);
      __syncthreads();
    }
    for (int item = warp; item < K * nseg_out; item += nw) {
      const int k = item / nseg_out, seg = item % nseg_out;
      const int e = s_expert[k];
      if (e < 0) continue;
      const int d = e / L, l = e % L;
      char* msg = peer_base(g, d) + half + c.ll.rows +
                  (static_cast<int64_t>(l * R + me) * c.max_tokens + s_pos[k]) * c.ll.msg_stride;
      const int off = seg * kSegBytes, bytes = min(kSegBytes, payload_bytes - off);
      if (p.use_fp8)
        copy_segment_from_shared(msg + kLowLatencyMsgHeader + off, s_row + off, bytes);
      else
        copy_segment_nc(msg + kLowLatencyMsgHeader + off, reinterpret_cast<const char*>(row) + off, bytes);
      if (seg == 0 && lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);  // one 16-byte header
    }
    __syncthreads();  // s_expert / s_pos / s_row are reused by the next token
  }
}

// The last block of a working send: every expert's count and flag to its owner (threads in parallel), counters
// reset. NOTE (ordering): every block fenced its peer stores (__threadfence_system) before counting itself done;
// the last block saw all of them counted, fenced, and then each thread writes counts, fences, releases flags.
__device__ __forceinline__ void publish_expert_counts(const DispatchSendParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local;
  const int64_t half = half_offset(c.ll, epoch);
  uint32_t* counts = reinterpret_cast<uint32_t*>(self_base(g) + c.ll.scratch);
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) {
    const int d = e / L, l = e % L;
    char* dst_half = peer_base(g, d) + half;
    const int32_t n = static_cast<int32_t>(atomicExch(counts + e, 0u));
    *reinterpret_cast<volatile int32_t*>(dst_half + c.ll.d_counts + 4 * (l * R + me)) = n;
    __threadfence_system();
    st_release_sys(header_word(dst_half, c.ll.d_flags + 4 * (l * R + me)), epoch);
  }
}

__global__ void __launch_bounds__(kSendThreads) ll_dispatch_send_kernel(const DispatchSendParams p) {
  extern __shared__ __align__(16) char s_row[];  // fp8: one quantized message payload (H + 4 * H/128 bytes)
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, p.num_tokens,
              p.fused ? "low-latency dispatch" : "low-latency dispatch send", &s_gate);
  __syncthreads();
  if (s_gate.work) dispatch_send_body(p, s_gate.epoch, s_row);  // block-uniform
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's peer stores and count atomics before it is counted
    uint32_t* done = ll_word(p.c.g, SignalHeader::kLlSendDone);
    s_last = atomicAdd(done, 1u) == gridDim.x * gridDim.y - 1;
    if (s_last) {
      atomicExch(done, 0u);
      __threadfence();
    }
  }
  __syncthreads();
  if (!s_last) return;
  if (s_gate.work) publish_expert_counts(p, s_gate.epoch);
  __syncthreads();
  if (threadIdx.x == 0) finish_send_last(p.c.g, p.io, s_gate);
}

// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void dispatch_recv_body(const DispatchRecvParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, H = c.hidden, Tm = c.max_tokens, rows_per_expert = R * Tm;
  const int l = blockIdx.x, part = blockIdx.y, parts = gridDim.y, tid = threadIdx.x;
  const char* half = self_base(g) + half_offset(c.ll, epoch);
  __shared__ int32_t s_off[kMaxGroupRanks + 1];
  __shared__ int32_t s_count[kMaxGroupRanks];
  if (tid < R) {
    wait_reached(header_word(const_cast<char*>(half), c.ll.d_flags + 4 * (l * R + tid)), epoch, g.timeout_ns,
                 "low-latency dispatch receive", g.rank, tid);
    const int32_t n = __ldcg(reinterpret_cast<const int32_t*>(half + c.ll.d_counts) + l * R + tid);
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
  const char* expert_msgs = half + c.ll.rows + static_cast<int64_t>(l) * R * Tm * c.ll.msg_stride;
  auto message = [&](int i) {
    const int s = source_of_row(s_off, R, i);
    return expert_msgs + static_cast<int64_t>(s * Tm + (i - s_off[s])) * c.ll.msg_stride;
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

__global__ void __launch_bounds__(kThreads) ll_dispatch_recv_kernel(const DispatchRecvParams p) {
  __shared__ Gate s_gate;
  if (threadIdx.x == 0) open_recv(p.io, &s_gate);
  __syncthreads();
  if (s_gate.work) dispatch_recv_body(p, s_gate.epoch);  // block-uniform
  finish_recv(p.c.g, p.io, s_gate);
}

// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void combine_send_body(const CombineSendParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, H = c.hidden, Tm = c.max_tokens;
  const int rows_per_expert = R * Tm, row_bytes = 2 * H;
  const int l = blockIdx.x, part = blockIdx.y, parts = gridDim.y, tid = threadIdx.x;
  const int64_t half = half_offset(c.ll, epoch);
  __shared__ int32_t s_off[kMaxGroupRanks + 1];
  if (tid == 0) {
    s_off[0] = 0;
    for (int s = 0; s < R; ++s) s_off[s + 1] = s_off[s] + min(max(__ldg(p.layout_range + l * R + s), 0), Tm);
  }
  if (tid < R) wait_consumed(g, tid, epoch);
  __syncthreads();
  const int total = s_off[R];
  const int nseg = (row_bytes + kSegBytes - 1) / kSegBytes;
  const char* rows = static_cast<const char*>(p.expert_out) + static_cast<int64_t>(l) * rows_per_expert * row_bytes;
  for (int item = part * num_warps() + warp_id(); item < total * nseg; item += parts * num_warps()) {
    const int i = item / nseg, seg = item % nseg, off = seg * kSegBytes;
    const int s = source_of_row(s_off, R, i);
    const int32_t t = __ldg(p.src_info + static_cast<int64_t>(l) * rows_per_expert + i);
    if (t < 0 || t >= Tm) continue;  // a corrupted handle never writes out of bounds
    char* dst = peer_base(g, s) + half + c.ll.rows +
                (static_cast<int64_t>(me * L + l) * Tm + t) * row_bytes + off;
    copy_segment_nc(dst, rows + static_cast<int64_t>(i) * row_bytes + off, min(kSegBytes, row_bytes - off));
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();  // this block's peer stores happen before it is counted
    uint32_t* blocks_done = reinterpret_cast<uint32_t*>(self_base(g) + c.ll.scratch) + l;
    if (atomicAdd(blocks_done, 1u) == static_cast<uint32_t>(parts - 1)) {
      atomicExch(blocks_done, 0u);
      __threadfence_system();
      for (int d = 0; d < R; ++d)
        st_release_sys(header_word(peer_base(g, d) + half, c.ll.c_flags + 4 * (me * L + l)), epoch);
    }
  }
}

__global__ void __launch_bounds__(kThreads) ll_combine_send_kernel(const CombineSendParams p) {
  __shared__ Gate s_gate;
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, 0, p.fused ? "low-latency combine" : "low-latency combine send", &s_gate);
  __syncthreads();
  if (s_gate.work) combine_send_body(p, s_gate.epoch);  // block-uniform
  finish_send(p.c.g, p.io, s_gate);
}

// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void combine_recv_body(const CombineRecvParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int E = c.num_experts, L = c.num_local, H = c.hidden, Tm = c.max_tokens, K = p.num_topk;
  const int t = blockIdx.x, part = blockIdx.y, parts = gridDim.y, tid = threadIdx.x;
  char* half = self_base(g) + half_offset(c.ll, epoch);
  __shared__ int32_t s_expert[kMaxTopk];
  __shared__ float s_weight[kMaxTopk];
  const bool has_token = t < p.num_tokens;  // T = 0 still runs one block: finish_recv must publish the epoch
  if (has_token && tid < K) {
    const int32_t e = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + tid);
    const bool valid = routing::valid_expert(e, E);
    if (valid)
      wait_reached(header_word(half, c.ll.c_flags + 4 * e), epoch, g.timeout_ns, "low-latency combine receive",
                   g.rank, e / L);
    // NOTE: the weight of a -1 / out-of-range slot is never loaded nor multiplied (the slot is skipped below), so a
    // NaN or inf weight there cannot reach y (0 * NaN = NaN would).
    s_expert[tid] = valid ? e : -1;
    s_weight[tid] = valid ? __ldg(p.topk_weights + static_cast<int64_t>(t) * K + tid) : 0.0f;
  }
  __syncthreads();
  const int n8 = H / 8;
  const char* rows = half + c.ll.rows;
  for (int ci = part * blockDim.x + tid; has_token && ci < n8; ci += parts * blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < K; ++k) {
      const int e = s_expert[k];
      if (e < 0) continue;
      const int4 v = ld_cg_v4(
          reinterpret_cast<const int4*>(rows + (static_cast<int64_t>(e) * Tm + t) * 2 * H) + ci);
      float f[8];
      unpack_bf16x8(v, f);
      const float w = s_weight[k];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, f[i], acc[i]);
    }
    int4 o;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) o2[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(p.y) + static_cast<int64_t>(t) * H)[ci] = o;
  }
}

__global__ void __launch_bounds__(kCombineRecvThreads) ll_combine_recv_kernel(const CombineRecvParams p) {
  __shared__ Gate s_gate;
  if (threadIdx.x == 0) open_recv(p.io, &s_gate);
  __syncthreads();
  if (s_gate.work) combine_recv_body(p, s_gate.epoch);  // block-uniform
  finish_recv(p.c.g, p.io, s_gate);
}

// Blocks per expert so that a call spreads over about two blocks per SM.
int parts_per_expert(const Ctx& c, int max_parts) {
  const int sms = c.sm_count > 0 ? c.sm_count : 132;
  return std::max(1, std::min(max_parts, (2 * sms + c.num_local - 1) / c.num_local));
}

Status launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Error(std::string(what) + " launch failed: " + cudaGetErrorString(e));
}

}  // namespace

Status preload_kernels() {
  return preload({reinterpret_cast<const void*>(ll_dispatch_send_kernel),
                  reinterpret_cast<const void*>(ll_dispatch_recv_kernel),
                  reinterpret_cast<const void*>(ll_combine_send_kernel),
                  reinterpret_cast<const void*>(ll_combine_recv_kernel)});
}

// Shared memory of the send kernel: an fp8 message payload (bf16 rows are copied from global memory directly).
int send_shared_bytes(const DispatchSendParams& p) {
  return p.use_fp8 ? static_cast<int>(align_up(p.c.hidden + 4 * (p.c.hidden / kFp8Block), 16)) : 0;
}

Status launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  const int sms = p.c.sm_count > 0 ? p.c.sm_count : 132;
  const int grid = std::max(1, std::min(p.num_tokens, 2 * sms));  // one block per token (T = 0: one block)
  const int smem = send_shared_bytes(p);
  if (smem > kMaxSendSharedBytes)
    return Status::Error("low-latency dispatch send: hidden=" + std::to_string(p.c.hidden) +
                         " needs " + std::to_string(smem) + " bytes of shared memory for one fp8 row (at most " +
                         std::to_string(kMaxSendSharedBytes) + ")");
  ll_dispatch_send_kernel<<<grid, kSendThreads, smem, stream>>>(p);
  return launched("low-latency dispatch send");
}

Status launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream) {
  const dim3 grid(p.c.num_local, parts_per_expert(p.c, 16));
  ll_dispatch_recv_kernel<<<grid, kThreads, 0, stream>>>(p);
  return launched("low-latency dispatch receive");
}

Status launch_dispatch(const DispatchSendParams& send, const DispatchRecvParams& recv, cudaStream_t stream) {
  JAX_EP_RETURN_IF_ERROR(launch_dispatch_send(send, stream));
  return launch_dispatch_recv(recv, stream);
}

Status launch_combine_send(const CombineSendParams& p, cudaStream_t stream) {
  const dim3 grid(p.c.num_local, parts_per_expert(p.c, 16));
  ll_combine_send_kernel<<<grid, kThreads, 0, stream>>>(p);
  return launched("low-latency combine send");
}

Status launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  const int sms = p.c.sm_count > 0 ? p.c.sm_count : 132;
  const int max_parts = std::max(1, (p.c.hidden / 8 + kCombineRecvThreads - 1) / kCombineRecvThreads);
  const int blocks = std::max(1, p.num_tokens);
  const int parts = std::max(1, std::min(max_parts, (2 * sms + blocks - 1) / blocks));
  ll_combine_recv_kernel<<<dim3(blocks, parts), kCombineRecvThreads, 0, stream>>>(p);
  return launched("low-latency combine receive");
}

Status launch_combine(const CombineSendParams& send, const CombineRecvParams& recv, cudaStream_t stream) {
  JAX_EP_RETURN_IF_ERROR(launch_combine_send(send, stream));
  return launch_combine_recv(recv, stream);
}

}  // namespace jax_ep::ll
