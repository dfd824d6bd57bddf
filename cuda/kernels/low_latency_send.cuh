// The low-latency dispatch send of both modes (per_expert: low_latency_kernels.cu, per_rank: low_latency_per_rank_kernels.cu's mode),
// one template: token-major, block b takes tokens b, b + grid, ... For each token it finds its distinct
// destinations (experts, or ranks in per_rank mode) and its position among the tokens sent to each (token order:
// the order the receiver packs), reads the row ONCE (fp8: quantizes it once into shared memory) and writes one
// message per destination. Counts per destination are summed in this rank's LL scratch words (atomics); the last
// block to finish publishes every destination's count and flag (its threads in parallel) and resets the counters.
//   per_expert  message at the owner's slot [l][me][position], header {token}; count/flag d_counts/d_flags[l][me]
//   per_rank    message at rank d's slot [me][position], header {token, local expert of every top-k slot or -1};
//               count/flag r_counts/r_flags[me]
// NOTE (why token-major): expert-major blocks re-read and re-quantize a token's row once per expert and need E
// blocks (three waves at E=288); here the work is T rows, one block per token, and the quantization runs once.
// NOTE (ordering of the publish): every block fenced its peer stores (__threadfence_system) before counting itself
// done; the last block saw all of them counted, fenced, and then each thread writes counts, fences, releases flags.
#pragma once

#include "kernels/low_latency_device.cuh"
#include "kernels/low_latency_protocol.cuh"
#include "transport/peer.cuh"

namespace jax_ep::low_latency {

template <bool kPerRank>
__device__ __forceinline__ void dispatch_send_body(const DispatchSendParams& p, uint32_t epoch, char* s_row) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, E = c.num_experts, H = c.hidden, K = p.num_topk;
  const int T = p.num_tokens, warp = warp_id(), lane = lane_id(), nw = num_warps();
  const int64_t half = half_offset(c.low_latency, epoch);
  const int header = kPerRank ? kRankMsgHeader : kLowLatencyMsgHeader;
  uint32_t* counts = reinterpret_cast<uint32_t*>(self_base(g) + c.low_latency.scratch);  // [E or R], zero between kernels
  __shared__ int32_t s_dest[kMaxTopk];
  __shared__ int32_t s_pos[kMaxTopk];
  __shared__ int32_t s_ids[kMaxTopk];
  __shared__ int32_t s_part[kSendThreads / 32][kMaxTopk];
  __shared__ __align__(16) float s_scales[kSendThreads / 32][kSegChannels / kFp8Block];
  if (threadIdx.x < R) wait_consumed(g, threadIdx.x, epoch);  // token_slots' first __syncthreads orders the rest
  const int payload_bytes = p.use_fp8 ? H + 4 * (H / kFp8Block) : 2 * H;  // fp8: q then the S scales
  const int nseg_in = (H + kSegChannels - 1) / kSegChannels;
  const int nseg_out = (payload_bytes + kSegBytes - 1) / kSegBytes;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (kPerRank && threadIdx.x < K) s_ids[threadIdx.x] = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + threadIdx.x);
    token_slots(p.topk_idx, t, K, E, kPerRank ? L : 1, s_dest, s_pos, s_part);
    if (threadIdx.x < K && s_dest[threadIdx.x] >= 0) atomicAdd(counts + s_dest[threadIdx.x], 1u);
    const __nv_bfloat16* row = reinterpret_cast<const __nv_bfloat16*>(p.x) + static_cast<int64_t>(t) * H;
    if (p.use_fp8) {  // quantize once into shared memory: [H fp8 | S f32], the message payload as it goes out
      for (int seg = warp; seg < nseg_in; seg += nw)
        quantize_segment(s_row, row, H, seg * kSegChannels, min(H, (seg + 1) * kSegChannels), s_scales[warp]);
      __syncthreads();
    }
    for (int item = warp; item < K * nseg_out; item += nw) {
      const int k = item / nseg_out, seg = item % nseg_out;
      const int dest = s_dest[k];
      if (dest < 0) continue;
      const int d = kPerRank ? dest : dest / L;
      char* msg = peer_base(g, d) + half + c.low_latency.rows;
      if (kPerRank)
        msg += (static_cast<int64_t>(me) * c.max_tokens + s_pos[k]) * c.low_latency.rank_msg_stride;
      else
        msg += (static_cast<int64_t>((dest % L) * R + me) * c.max_tokens + s_pos[k]) * c.low_latency.msg_stride;
      const int off = seg * kSegBytes, bytes = min(kSegBytes, payload_bytes - off);
      if (p.use_fp8)
        copy_segment_from_shared(msg + header + off, s_row + off, bytes);
      else
        copy_segment_nc(msg + header + off, reinterpret_cast<const char*>(row) + off, bytes);
      if (seg != 0) continue;
      if (lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);
      if (kPerRank && lane < kMaxTopk) {  // the local expert of every top-k slot on rank d (-1 elsewhere)
        const int32_t e = lane < K ? s_ids[lane] : -1;
        const bool here = layout::valid_expert(e, E) && e / L == d;
        reinterpret_cast<int32_t*>(msg + 16)[lane] = here ? e % L : -1;
      }
    }
    __syncthreads();  // s_dest / s_pos / s_ids / s_row are reused by the next token
  }
}

// The last block of a working send: every destination's count and flag (threads in parallel), counters reset.
template <bool kPerRank>
__device__ __forceinline__ void publish_counts(const DispatchSendParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local;
  const int64_t half = half_offset(c.low_latency, epoch);
  uint32_t* counts = reinterpret_cast<uint32_t*>(self_base(g) + c.low_latency.scratch);
  for (int dest = threadIdx.x; dest < (kPerRank ? R : c.num_experts); dest += blockDim.x) {
    const int d = kPerRank ? dest : dest / L;
    char* dst_half = peer_base(g, d) + half;
    const int32_t n = static_cast<int32_t>(atomicExch(counts + dest, 0u));
    const int64_t count_at = kPerRank ? c.low_latency.rank_words + 4 * (RankWord::kCounts + me)
                                      : c.low_latency.d_counts + 4 * ((dest % L) * R + me);
    const int64_t flag_at = kPerRank ? c.low_latency.rank_words + 4 * (RankWord::kFlags + me)
                                     : c.low_latency.d_flags + 4 * ((dest % L) * R + me);
    *reinterpret_cast<volatile int32_t*>(dst_half + count_at) = n;
    __threadfence_system();
    st_release_sys(header_word(dst_half, flag_at), epoch);  // every destination, 0 messages too
  }
}

template <bool kPerRank>
__global__ void __launch_bounds__(kSendThreads) low_latency_dispatch_send_kernel(const DispatchSendParams p) {
  extern __shared__ __align__(16) char s_row[];  // fp8: one quantized message payload (H + 4 * H/128 bytes)
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, p.num_tokens,
              p.fused ? "low-latency dispatch" : "low-latency dispatch send", &s_gate);
  __syncthreads();
  if (s_gate.work) dispatch_send_body<kPerRank>(p, s_gate.epoch, s_row);  // block-uniform
  if (!last_block_all(low_latency_word(p.c.g, SignalHeader::kLowLatencySendDone), &s_last)) return;
  if (s_gate.work) publish_counts<kPerRank>(p, s_gate.epoch);
  __syncthreads();
  if (threadIdx.x == 0) finish_send_last(p.c.g, p.io, s_gate);
}

}  // namespace jax_ep::low_latency
