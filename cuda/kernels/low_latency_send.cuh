// The low-latency dispatch send of both modes (per_expert: low_latency_kernels.cu, per_rank:
// low_latency_per_rank_kernels.cu's mode), one template: token-major, the send's block b of B (its BlockPlace) takes
// tokens b, b + B, ... For each token it finds its distinct destinations (experts, or ranks in per_rank mode) and its
// position among the tokens sent to each (token order: the order the receiver packs), reads the row ONCE (fp8:
// quantizes it once into shared memory) and writes one message per destination. Counts are summed in this rank's LL
// scratch words (atomics); the last block to finish publishes every count and flag (its threads in parallel) and resets
// the counters.
//   per_expert  message at the owner's slot [l][me][position], header {token}; count and epoch in d_flags[l][me]
//   per_rank    message at rank d's slot [me][position], header {token, local expert and row position of every
//               top-k slot (-1 elsewhere)}; counts r_counts[me] (messages) and d_counts[l][me] (rows of each local
//               expert l), then the flag r_flags[me]: the receiver places every row without scanning the messages
// NOTE (why token-major): expert-major blocks re-read and re-quantize a token's row once per expert and need E
// blocks (three waves at E=288); here the work is T rows, one block per token, and the quantization runs once.
// NOTE (ordering of the publish): every block takes a GPU-scope acq_rel ticket after its peer stores
// (common/last_block.cuh); the last block acquired all of them, then each thread releases destinations' flags
// (st.release.sys: cumulative over every block's stores; per_expert: each flag is an epoch word carrying its count;
// per_rank: the counts of every destination, __syncthreads, then each destination's flag).
#pragma once

#include "kernels/low_latency_device.cuh"
#include "kernels/low_latency_protocol.cuh"
#include "transport/peer.cuh"

namespace jax_ep::low_latency {

template <bool kPerRank>
__device__ __forceinline__ void dispatch_send_body(const DispatchSendParams& p, uint32_t epoch, char* s_row,
                                                   const BlockPlace& b) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, E = c.num_experts, H = c.hidden, K = p.num_topk;
  const int T = p.num_tokens, warp = warp_id(), lane = lane_id(), nw = num_warps();
  const int64_t half = half_offset(c.low_latency, epoch);
  const int header = kPerRank ? kRankMsgHeader : kLowLatencyMsgHeader;
  // [E] rows per expert, then (per_rank) [kMaxGroupRanks] messages per rank at kLowLatencyScratchRanks; zero between
  // kernels
  uint32_t* counts = reinterpret_cast<uint32_t*>(self_base(g) + c.low_latency.scratch);
  __shared__ int32_t s_dest[kMaxTopk];
  __shared__ int32_t s_pos[kMaxTopk];
  __shared__ int32_t s_ids[kMaxTopk];
  __shared__ int32_t s_part[kSendThreads / 32][kMaxTopk];
  __shared__ int32_t s_epos[kMaxTopk];                          // per_rank: row position of each slot's expert
  __shared__ int32_t s_epart[kPerRank ? kSendThreads / 32 : 1][kMaxTopk];
  __shared__ __align__(16) float s_scales[kSendThreads / 32][kSegChannels / kFp8Block];
  if (threadIdx.x < R) wait_consumed(g, threadIdx.x, epoch);  // token_slots' first __syncthreads orders the rest
  phase_stamp(g_ll_phases, kPhaseSendConsumed);
  const int payload_bytes = p.use_fp8 ? H + 4 * (H / kFp8Block) : 2 * H;  // fp8: q then the S scales
  const int nseg_in = (H + kSegChannels - 1) / kSegChannels;
  const int nseg_out = (payload_bytes + kSegBytes - 1) / kSegBytes;
  for (int t = b.x; t < T; t += b.nx) {
    if (kPerRank && threadIdx.x < K) s_ids[threadIdx.x] = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + threadIdx.x);
    if (kPerRank) {
      token_slots<true>(p.topk_idx, t, K, E, L, s_dest, s_pos, s_part, s_epos, s_epart);
      if (threadIdx.x < K) {
        const int k = threadIdx.x;
        if (s_dest[k] >= 0) atomicAdd(counts + kLowLatencyScratchRanks + s_dest[k], 1u);  // one message per rank
        bool first = s_epos[k] >= 0;  // one row per distinct expert
        for (int j = 0; j < k; ++j) first &= s_ids[j] != s_ids[k];
        if (first) atomicAdd(counts + s_ids[k], 1u);
      }
    } else {
      token_slots(p.topk_idx, t, K, E, 1, s_dest, s_pos, s_part);
      if (threadIdx.x < K && s_dest[threadIdx.x] >= 0) atomicAdd(counts + s_dest[threadIdx.x], 1u);
    }
    phase_stamp(g_ll_phases, kPhaseSendSlots);  // token_slots ends with a block barrier
    const __nv_bfloat16* row = reinterpret_cast<const __nv_bfloat16*>(p.x) + static_cast<int64_t>(t) * H;
    if (p.use_fp8) {  // quantize once into shared memory: [H fp8 | S f32], the message payload as it goes out
      for (int seg = warp; seg < nseg_in; seg += nw)
        quantize_segment(s_row, row, H, seg * kSegChannels, min(H, (seg + 1) * kSegChannels), s_scales[warp]);
      __syncthreads();
      phase_stamp(g_ll_phases, kPhaseSendQuantized);
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
      if (kPerRank && lane < kMaxTopk) {  // the local expert and row position of every top-k slot on rank d
        const int32_t e = lane < K ? s_ids[lane] : -1;
        const bool here = layout::valid_expert(e, E) && e / L == d;
        reinterpret_cast<int32_t*>(msg + kRankMsgLocalExperts)[lane] = here ? e % L : -1;
        reinterpret_cast<int32_t*>(msg + kRankMsgPositions)[lane] = here ? s_epos[lane] : -1;
      }
    }
    __syncthreads();  // s_dest / s_pos / s_epos / s_ids / s_row are reused by the next token
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
  if constexpr (kPerRank) {
    for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x)
      *reinterpret_cast<volatile int32_t*>(peer_base(g, e / L) + half + c.low_latency.d_counts +
                                           4 * ((e % L) * R + me)) = static_cast<int32_t>(atomicExch(counts + e, 0u));
    for (int d = threadIdx.x; d < R; d += blockDim.x)
      *reinterpret_cast<volatile int32_t*>(peer_base(g, d) + half + c.low_latency.rank_words +
                                           4 * (RankWord::kCounts + me)) =
          static_cast<int32_t>(atomicExch(counts + kLowLatencyScratchRanks + d, 0u));
    __syncthreads();  // every count of every destination is stored before any flag
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      st_release_sys(header_word(peer_base(g, d) + half, c.low_latency.rank_words + 4 * (RankWord::kFlags + me)),
                     epoch);  // every destination, 0 messages too
    }
  } else {
    for (int dest = threadIdx.x; dest < c.num_experts; dest += blockDim.x) {
      uint64_t* word = reinterpret_cast<uint64_t*>(peer_base(g, dest / L) + half + c.low_latency.d_flags) +
                       (dest % L) * R + me;
      st_release_sys_u64(word, epoch_word(epoch, atomicExch(counts + dest, 0u)));  // 0 rows too
    }
  }
}

template <bool kPerRank>
__global__ void __launch_bounds__(kSendThreads) low_latency_dispatch_send_kernel(const DispatchSendParams p) {
  extern __shared__ __align__(16) char s_row[];  // fp8: one quantized message payload (H + 4 * H/128 bytes)
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  phase_begin(g_ll_phases);
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, p.num_tokens,
              p.fused ? "low-latency dispatch" : "low-latency dispatch send", &s_gate);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendOpened);
  if (s_gate.work) dispatch_send_body<kPerRank>(p, s_gate.epoch, s_row, BlockPlace::of_grid());  // block-uniform
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendBody);
  if (!last_block<TicketScope::kGpu>(low_latency_word(p.c.g, SignalHeader::kLowLatencySendDone), &s_last)) return;
  phase_stamp(g_ll_phases, kPhaseSendLast);
  if (s_gate.work) publish_counts<kPerRank>(p, s_gate.epoch);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendPublished);
  if (threadIdx.x == 0) finish_send_last(p.c.g, p.io, s_gate);
}

}  // namespace jax_ep::low_latency
