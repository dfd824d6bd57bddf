// Low-latency per_rank mode (EPConfig.low_latency_mode, docs/SPEC.md §4): one message per (token, destination
// rank) instead of one per (token, expert); the outputs are those of per_expert mode (low_latency_kernels.cu), plus the
// handle's message tables.
//
//   dispatch send   low_latency_send.cuh (shared with per_expert mode, launched from low_latency_kernels.cu): one block
//                   per token, one message per destination rank into [me][position], with a header naming the local
//                   expert and its row position of every top-k slot; the last block publishes each rank's message
//                   count and per-expert row counts, then its flag.
//   dispatch recv   a one-wave grid over the messages: wait for every source's flag, read the row counts, and place
//                   every message's payload straight at its rows of recv_x (same row order as per_expert: source
//                   rank, then token); the handle's tables (src_info, layout_range, msg_token, token_rows) alongside.
//   combine send    the first block to start (place 0) pushes this rank's topk_weights [T, K] into every rank's
//                   weights area, then w_flags; every block takes warp items (message (s, j), segment) over a
//                   one-wave grid: partial = sum over k in order of w[s][t][k] * expert_out[row] in f32 (rows from
//                   token_rows; w from source s's push, or this rank's own topk_weights when s is this rank), stored
//                   as bf16 at rank s, slot [me][t]; the last block raises p_flags.
//   combine recv    blocks (t, part): wait for the p_flags of t's ranks; y[t] = sum over them (ascending) in f32.
//   combine (fused) one kernel: send places (ticket order) then receive places (low_latency_protocol.cuh, fused_frame).
//
// Protocol (epochs, halves, state/token, consumed words) as in low_latency_kernels.cu (low_latency_protocol.cuh); layout of the
// per_rank words, messages and weights: staging_layout.h. Memory ordering as in transport/peer.cuh.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "common/copy.cuh"
#include "common/preload.cuh"
#include "common/ptx.cuh"
#include "common/thread.cuh"
#include "jax_ep/api.h"
#include "jax_ep/layout_params.h"
#include "kernels/low_latency_device.cuh"
#include "kernels/low_latency_protocol.cuh"
#include "kernels/low_latency_per_rank_kernels.h"
#include "transport/peer.cuh"

namespace jax_ep::low_latency::per_rank {
namespace {

__device__ __forceinline__ uint32_t* rank_word(char* half_base, const LowLatencyLayout& low_latency, int word) {
  return header_word(half_base, low_latency.rank_words + 4 * word);
}

// ---------------------------------------------------------------------------------------------------------------
// Every block: wait for every source's flag, then read the counts into shared memory (s_cnt[l][s] rows of local
// expert l from source s, s_off[l][s] those from sources before s). A message's header names, per top-k slot, the
// local expert and the row position among its source's rows of that expert, so row i of recv_x[l] for slot k of
// message (s, j) is s_off[l][s] + position: every block places its share of the messages with no scan and no
// block-to-block order. Two grid-strided passes, independent of each other:
//   tables   layout_range, recv_count; per (message, top-k slot) msg_token, token_rows and src_info of the placed
//            row; src_info -1 past each expert's rows
//   rows     warp items (message, segment): the segment is loaded once and stored to each distinct local expert of
//            the message; segment 0 also copies the fp8 scales
// NOTE (bounds): counts are clamped to [0, T_max], local experts to [0, L) and positions to [0, count): a slot naming
// anything else is -1 in token_rows and places no row, so nothing is written out of bounds (the token in a message
// header is copied to msg_token / src_info as sent).
__device__ __forceinline__ void dispatch_recv_body(const DispatchRecvParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, L = c.num_local, H = c.hidden, Tm = c.max_tokens, K = p.num_topk, rows = R * Tm;
  const int tid = threadIdx.x, lane = lane_id();
  const int gtid = blockIdx.x * blockDim.x + tid, gthreads = gridDim.x * blockDim.x;
  char* half = self_base(g) + half_offset(c.low_latency, epoch);
  __shared__ int32_t s_n[kMaxGroupRanks];            // messages from source s
  __shared__ int32_t s_first[kMaxGroupRanks + 1];    // messages from sources before s
  __shared__ int32_t s_cnt[kMaxLowLatencyExperts];   // [l][s] (E = L * R <= kMaxLowLatencyExperts)
  __shared__ int32_t s_off[kMaxLowLatencyExperts];   // [l][s]
  if (tid < R) {
    wait_reached(rank_word(half, c.low_latency, RankWord::kFlags + tid), epoch, g.timeout_ns,
                 "low-latency dispatch receive (per_rank)", g.rank, tid);
    const int32_t n = __ldcg(reinterpret_cast<const int32_t*>(rank_word(half, c.low_latency, RankWord::kCounts + tid)));
    s_n[tid] = min(max(n, 0), Tm);  // never trust a count beyond the slots
  }
  __syncthreads();  // every flag seen: the counts of every source are readable
  for (int idx = tid; idx < L * R; idx += blockDim.x)
    s_cnt[idx] = min(max(__ldcg(reinterpret_cast<const int32_t*>(half + c.low_latency.d_counts) + idx), 0), Tm);
  if (tid == 0) {
    s_first[0] = 0;
    for (int s = 0; s < R; ++s) s_first[s + 1] = s_first[s] + s_n[s];
  }
  __syncthreads();
  for (int l = tid; l < L; l += blockDim.x) {
    int32_t run = 0;
    for (int s = 0; s < R; ++s) {
      s_off[l * R + s] = run;
      run += s_cnt[l * R + s];
    }
  }
  __syncthreads();
  auto message = [&](int s, int j) -> const char* {
    return half + c.low_latency.rows + (static_cast<int64_t>(s) * Tm + j) * c.low_latency.rank_msg_stride;
  };
  // Flattened row of recv_x (l * rows + i) for slot k of message (s, j), or -1.
  auto slot_row = [&](const char* msg, int s, int k) -> int32_t {
    const int32_t l = __ldcg(reinterpret_cast<const int32_t*>(msg + kRankMsgLocalExperts) + k);
    const int32_t pos = __ldcg(reinterpret_cast<const int32_t*>(msg + kRankMsgPositions) + k);
    if (l < 0 || l >= L || pos < 0 || pos >= s_cnt[l * R + s]) return -1;
    return l * rows + s_off[l * R + s] + pos;
  };
  // ---- tables ----
  for (int idx = gtid; idx < L * R; idx += gthreads) p.layout_range[idx] = s_cnt[idx];
  for (int l = gtid; l < L; l += gthreads) p.recv_count[l] = s_off[l * R + R - 1] + s_cnt[l * R + R - 1];
  for (int64_t idx = gtid; idx < static_cast<int64_t>(R) * Tm * K; idx += gthreads) {  // one (message, slot) each
    const int m = static_cast<int>(idx / K), k = static_cast<int>(idx % K), s = m / Tm, j = m % Tm;
    const bool valid = j < s_n[s];
    const char* msg = message(s, j);
    const int32_t token = valid ? __ldcg(reinterpret_cast<const int32_t*>(msg)) : -1;
    const int32_t row = valid ? slot_row(msg, s, k) : -1;
    if (k == 0) p.msg_token[m] = token;
    p.token_rows[idx] = row;
    if (row >= 0) p.src_info[row] = token;  // a repeated expert writes the same value twice
  }
  for (int64_t idx = gtid; idx < static_cast<int64_t>(L) * rows; idx += gthreads) {
    const int l = static_cast<int>(idx / rows), i = static_cast<int>(idx % rows);
    if (i >= s_off[l * R + R - 1] + s_cnt[l * R + R - 1]) p.src_info[idx] = -1;
  }
  // ---- rows ----
  const int payload_bytes = p.use_fp8 ? H : 2 * H;
  const int nseg = (payload_bytes + kSegBytes - 1) / kSegBytes;
  const int S = H / kFp8Block;
  char* out = static_cast<char*>(p.recv_x);
  const int messages = s_first[R];
  for (int item = global_warp(); item < messages * nseg; item += num_global_warps()) {
    const int m = item / nseg, seg = item % nseg, off = seg * kSegBytes;
    const int s = source_of_row(s_first, R, m);  // the source whose messages hold valid message m
    const char* msg = message(s, m - s_first[s]);
    int32_t row = lane < K ? slot_row(msg, s, lane) : -1;
    for (int k = 0; k < K; ++k) {  // a repeated expert's row is stored by its first slot only
      const int32_t earlier = __shfl_sync(0xffffffffu, row, k);
      if (k < lane && earlier == row) row = -1;
    }
    uint32_t targets = __ballot_sync(0xffffffffu, row >= 0);
    const int bytes = min(kSegBytes, payload_bytes - off);
    int4 v[4];
    load_segment_cg(msg + kRankMsgHeader + off, bytes, v);
    while (targets != 0u) {
      const int k = __ffs(targets) - 1;
      targets &= targets - 1u;
      const int32_t r = __shfl_sync(0xffffffffu, row, k);
      store_segment(out + static_cast<int64_t>(r) * payload_bytes + off, bytes, v);
      if (p.use_fp8 && seg == 0)
        for (int col = lane; col < S; col += 32)
          p.recv_x_scales[static_cast<int64_t>(r) * S + col] =
              __ldcg(reinterpret_cast<const float*>(msg + kRankMsgHeader + H) + col);
    }
  }
}

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_per_rank_dispatch_recv_kernel(const __grid_constant__ DispatchRecvParams p) {
  receive_frame(p, [&](uint32_t epoch) { dispatch_recv_body(p, epoch); });
}

// ---------------------------------------------------------------------------------------------------------------
// The combine's weight push, by the send's place 0 (the first send block to start, so it runs while the peers' send
// blocks that need it wait): once every rank has read op n-2 from its half, this rank's topk_weights [T, K] into every
// other rank's weights area [me][t][k], then w_flags[me] there (peer stores -> __syncthreads -> st.release.sys). This
// rank's own items read topk_weights directly (combine_send_body).
// NOTE (what w_flags[s] tells the waiter): source s raised it after every rank, s included, had consumed op n-2, so
// a block that has seen it may store into s's half.
__device__ __forceinline__ void push_weights(const CombineSendParams& p, uint32_t epoch) {
  const GroupCtx& g = p.c.g;
  const int R = g.num_ranks, me = g.rank, Tm = p.c.max_tokens, K = p.num_topk, T = min(p.num_tokens, Tm);
  if (threadIdx.x < R) wait_consumed(g, threadIdx.x, epoch);
  __syncthreads();
  const int64_t half = half_offset(p.c.low_latency, epoch);
  for (int d = 0; d < R; ++d) {
    if (d == me) continue;
    float* dst = reinterpret_cast<float*>(peer_base(g, d) + half + p.c.low_latency.weights) +
                 static_cast<int64_t>(me) * Tm * kMaxTopk;
    for (int idx = threadIdx.x; idx < T * K; idx += blockDim.x)
      dst[(idx / K) * kMaxTopk + idx % K] = __ldg(p.topk_weights + idx);
  }
  __syncthreads();
  if (threadIdx.x < R && threadIdx.x != me)
    st_release_sys(rank_word(peer_base(g, threadIdx.x) + half, p.c.low_latency, RankWord::kWeightFlags + me), epoch);
}

// Warp items (message, segment) over the send places, for the message slots [s][0, T) (every rank calls with the
// same T, so source s sent at most T messages, packed from position 0): the warp's lanes < K read the message's rows
// and weights, then every lane sums its 4 vectors of the segment (two passes of 2) over the rows in k order (fmaf in
// f32, the SPEC's order) and stores the bf16 partial at rank s.
// NOTE (waits): a block first waits, one thread per source, for w_flags[s] of every source s != me its items store
// to (then __syncthreads), so its items read s's weights and store into s's half only after it; a block whose
// items are all this rank's waits for nothing: the send's decision already saw op n-2 consumed here
// (send_decision), and its weights are this rank's own topk_weights, the values place 0 pushes.
__device__ __forceinline__ void combine_send_body(const CombineSendParams& p, uint32_t epoch, const BlockPlace& b) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, H = c.hidden, Tm = c.max_tokens, K = p.num_topk;
  const int lane = lane_id(), row_bytes = 2 * H, nseg = (row_bytes + kSegBytes - 1) / kSegBytes;
  const int64_t half = half_offset(c.low_latency, epoch);
  char* self_half = self_base(g) + half;
  const int64_t num_rows = static_cast<int64_t>(L) * R * Tm;
  const char* expert_out = static_cast<const char*>(p.expert_out);
  const int T = min(p.num_tokens, Tm), items = R * T * nseg;
  __shared__ uint32_t s_need[kMaxGroupRanks / 32];  // bit s: an item of this block stores to source s != me
  for (int i = threadIdx.x; i < kMaxGroupRanks / 32; i += blockDim.x) s_need[i] = 0u;
  __syncthreads();
  if (lane == 0)
    for (int item = b.global_warp(); item < items; item += b.num_global_warps()) {
      const int s = item / nseg / T;
      if (s != me) atomicOr(&s_need[s >> 5], 1u << (s & 31));
    }
  __syncthreads();
  for (int s = threadIdx.x; s < R; s += blockDim.x)
    if ((s_need[s >> 5] >> (s & 31)) & 1u)
      wait_reached(rank_word(self_half, c.low_latency, RankWord::kWeightFlags + s), epoch, g.timeout_ns,
                   "low-latency combine send (per_rank, weights)", g.rank, s);
  __syncthreads();
  for (int item = b.global_warp(); item < items; item += b.num_global_warps()) {
    const int sp = item / nseg, seg = item % nseg, off = seg * kSegBytes, s = sp / T, m = s * Tm + sp % T;
    const int32_t t = __ldg(p.msg_token + m);
    // no message in this slot, or a token no rank has in this call (every rank calls with the same T: a handle of a
    // larger call, or a corrupted one): never out of bounds of topk_weights [T, K] or the slots
    if (t < 0 || t >= T) continue;
    int64_t row = -1;
    float w = 0.0f;
    if (lane < K) {
      const int32_t r = __ldg(p.token_rows + static_cast<int64_t>(m) * K + lane);
      if (r >= 0 && r < num_rows) {
        row = r;
        w = s == me ? __ldg(p.topk_weights + static_cast<int64_t>(t) * K + lane)
                    : __ldcg(reinterpret_cast<const float*>(self_half + c.low_latency.weights) +
                             (static_cast<int64_t>(s) * Tm + t) * kMaxTopk + lane);
      }
    }
    const int n16 = min(kSegBytes, row_bytes - off) / 16;
    char* dst = peer_base(g, s) + half + c.low_latency.rows + (static_cast<int64_t>(me) * Tm + t) * row_bytes + off;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // two passes of 2 vectors per lane (4 would spill under the 64-register cap)
      float acc[2][8];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
      for (int k = 0; k < K; ++k) {
        const int64_t rk = __shfl_sync(0xffffffffu, row, k);
        const float wk = __shfl_sync(0xffffffffu, w, k);
        if (rk < 0) continue;  // warp-uniform
        const int4* src = reinterpret_cast<const int4*>(expert_out + rk * row_bytes + off);
        int4 v[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int j = (2 * h + u) * 32 + lane;
          if (j < n16) v[u] = ld_nc_v4(src + j);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u)
          if ((2 * h + u) * 32 + lane < n16) fma_bf16x8(acc[u], wk, v[u]);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = (2 * h + u) * 32 + lane;
        if (j < n16) st_v4(reinterpret_cast<int4*>(dst) + j, pack_bf16x8(acc[u]));
      }
    }
  }
}

// A send place's whole part: place 0 pushes the weights first.
__device__ __forceinline__ void combine_send_place(const CombineSendParams& p, uint32_t epoch, int place, int places) {
  if (place == 0) push_weights(p, epoch);
  combine_send_body(p, epoch, BlockPlace{place, 0, places, 1});
}

// The send's last block: p_flags[me] at every rank.
__device__ __forceinline__ void publish_partial_flags(const CombineSendParams& p, uint32_t epoch) {
  const GroupCtx& g = p.c.g;
  if (threadIdx.x < g.num_ranks)
    st_release_sys(rank_word(peer_base(g, threadIdx.x) + half_offset(p.c.low_latency, epoch), p.c.low_latency,
                             RankWord::kPartialFlags + g.rank),
                   epoch);
}

// The split send: places by a ticket (SignalHeader::kLowLatencyRoleTicket, taken at the block's start and reset by
// the last block, after every block took one), so place 0, which the others may wait for, belongs to a block that
// has started.
__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm) low_latency_per_rank_combine_send_kernel(const __grid_constant__ CombineSendParams p) {
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  __shared__ int32_t s_place;
  const GroupCtx& g = p.c.g;
  phase_begin(g_ll_phases);
  if (threadIdx.x == 0) {
    open_send(g, p.io, p.fused, 0, p.fused ? "low-latency combine" : "low-latency combine send", &s_gate);
    s_place = static_cast<int32_t>(atom_add_acq_rel_gpu(low_latency_word(g, SignalHeader::kLowLatencyRoleTicket), 1u));
  }
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendOpened);
  if (s_gate.work) combine_send_place(p, s_gate.epoch, s_place, static_cast<int>(gridDim.x));  // block-uniform
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendBody);
  if (!last_block<TicketScope::kGpu>(low_latency_word(g, SignalHeader::kLowLatencySendDone), &s_last)) return;
  phase_stamp(g_ll_phases, kPhaseSendLast);
  if (s_gate.work) publish_partial_flags(p, s_gate.epoch);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendPublished);
  if (threadIdx.x == 0) {
    *low_latency_word(g, SignalHeader::kLowLatencyRoleTicket) = 0u;
    finish_send_last(g, p.io, s_gate);
  }
}

// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void combine_recv_body(const CombineRecvParams& p, uint32_t epoch, const BlockPlace& b) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int E = c.num_experts, L = c.num_local, H = c.hidden, Tm = c.max_tokens, K = p.num_topk;
  const int part = b.y, parts = b.ny, tid = threadIdx.x;
  char* half = self_base(g) + half_offset(c.low_latency, epoch);
  __shared__ int32_t s_ranks[kMaxTopk];  // the ranks the token's valid experts live on, ascending, each once
  __shared__ int32_t s_num_ranks;
  const char* rows = half + c.low_latency.rows;
  // Tokens t = b.x, b.x + b.nx, ... (combine_recv_grid: one wave); T = 0 runs no iteration and
  // the frame's finish_recv still publishes the epoch.
  for (int t = b.x; t < p.num_tokens; t += b.nx) {
    __syncthreads();  // the previous token's readers of s_ranks are done
    if (tid == 0) {
      int n = 0;
      for (int k = 0; k < K; ++k) {
        const int32_t e = __ldg(p.topk_idx + static_cast<int64_t>(t) * K + k);
        if (!layout::valid_expert(e, E)) continue;  // masked slots (any weight) never contribute
        const int32_t r = e / L;
        int at = n;  // insertion into the sorted list, skipping a rank already there
        while (at > 0 && s_ranks[at - 1] > r) --at;
        if (at > 0 && s_ranks[at - 1] == r) continue;
        for (int i = n; i > at; --i) s_ranks[i] = s_ranks[i - 1];
        s_ranks[at] = r;
        ++n;
      }
      s_num_ranks = n;
    }
    __syncthreads();
    const int n = s_num_ranks;
    for (int i = tid; i < n; i += blockDim.x)
      wait_reached(rank_word(half, c.low_latency, RankWord::kPartialFlags + s_ranks[i]), epoch, g.timeout_ns,
                   "low-latency combine receive (per_rank)", g.rank, s_ranks[i]);
    __syncthreads();
    for (int ci = part * blockDim.x + tid; ci < H / 8; ci += parts * blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      constexpr int kTerms = kTermsInFlight / 2;  // 4 int4 in flight: 8 would spill under the 64-register cap
      for (int i0 = 0; i0 < n; i0 += kTerms) {  // the chunk's loads in flight, then ascending rank order (SPEC)
        int4 v[kTerms];
#pragma unroll
        for (int u = 0; u < kTerms; ++u)
          if (i0 + u < n) {
            const int64_t row = static_cast<int64_t>(s_ranks[i0 + u]) * Tm + t;
            v[u] = ld_cg_v4(reinterpret_cast<const int4*>(rows + row * 2 * H) + ci);
          }
#pragma unroll
        for (int u = 0; u < kTerms; ++u) {
          if (i0 + u >= n) continue;
          float f[8];
          unpack_bf16x8(v[u], f);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        }
      }
      const int4 o = pack_bf16x8(acc);
      reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(p.y) + static_cast<int64_t>(t) * H)[ci] = o;
    }
  }
}

__global__ void __launch_bounds__(kCombineRecvThreads) low_latency_per_rank_combine_recv_kernel(const __grid_constant__ CombineRecvParams p) {
  receive_frame(p, [&](uint32_t epoch) { combine_recv_body(p, epoch, BlockPlace::of_grid()); });
}

// ---------------------------------------------------------------------------------------------------------------
// The fused combine: send places (weight push, partial sums, p_flags) and receive places in one kernel, no launch
// between them (low_latency_protocol.cuh, fused_frame).
// NOTE (settle): send blocks read this rank's half (the peers' weights) while receive blocks may all be done (a rank
// none of whose tokens has an expert here never waits for its own partials), so the receive's last block waits for
// p_flags[me], raised by the send's last block after every send block, before it releases "consumed".

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_per_rank_combine_fused_kernel(const __grid_constant__ CombineFusedParams p) {
  const int bx = p.recv_tokens;
  fused_frame(
      p.send.c.g, p.send.io, "low-latency combine", p.senders,
      [&](uint32_t epoch, int place) { combine_send_place(p.send, epoch, place, p.senders); },
      [&](uint32_t epoch) { publish_partial_flags(p.send, epoch); },
      [&](uint32_t epoch, int place, int places) {
        combine_recv_body(p.recv, epoch, BlockPlace{place % bx, place / bx, bx, places / bx});
      },
      [&](uint32_t epoch) {
        const GroupCtx& g = p.send.c.g;
        if (threadIdx.x == 0)
          wait_reached(rank_word(self_base(g) + half_offset(p.send.c.low_latency, epoch), p.send.c.low_latency,
                                 RankWord::kPartialFlags + g.rank),
                       epoch, g.timeout_ns, "low-latency combine (per_rank, this rank's send)", g.rank, g.rank);
        __syncthreads();  // the acquire before every thread's release of "consumed"
      });
}

}  // namespace

Status preload_kernels() {
  JAX_EP_RETURN_IF_ERROR(ll_phase_devices().arm(g_ll_phases));
  return preload({reinterpret_cast<const void*>(low_latency_per_rank_dispatch_recv_kernel),
                  reinterpret_cast<const void*>(low_latency_per_rank_combine_send_kernel),
                  reinterpret_cast<const void*>(low_latency_per_rank_combine_recv_kernel),
                  reinterpret_cast<const void*>(low_latency_per_rank_combine_fused_kernel)});
}

Status add_phases(bool reset, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits) {
  return ll_phase_devices().read(g_ll_phases, reset, ns, hits);
}

Status launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream) {
  // (message, segment) items of R * T_max messages at most
  const int payload_bytes = p.use_fp8 ? p.c.hidden : 2 * p.c.hidden;
  const int64_t items = static_cast<int64_t>(p.c.g.num_ranks) * p.c.max_tokens *
                        ((payload_bytes + kSegBytes - 1) / kSegBytes);
  low_latency_per_rank_dispatch_recv_kernel<<<one_wave_blocks(p.c, items), kThreads, 0, stream>>>(p);
  return launched("low-latency dispatch receive (per_rank)");
}

// (message, segment) items: R sources' messages at positions [0, T) (combine_send_body)
static int combine_send_grid(const CombineSendParams& p) {
  return one_wave_blocks(p.c, std::max<int64_t>(1, static_cast<int64_t>(p.c.g.num_ranks) *
                                                       std::min(p.num_tokens, p.c.max_tokens) *
                                                       ((2 * p.c.hidden + kSegBytes - 1) / kSegBytes)));
}

Status launch_combine_send(const CombineSendParams& p, cudaStream_t stream) {
  low_latency_per_rank_combine_send_kernel<<<combine_send_grid(p), kThreads, 0, stream>>>(p);
  return launched("low-latency combine send (per_rank)");
}

Status launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  const dim3 grid = combine_recv_grid(p, kCombineRecvThreads);
  low_latency_per_rank_combine_recv_kernel<<<grid, kCombineRecvThreads, 0, stream>>>(p);
  return launched("low-latency combine receive (per_rank)");
}

Status launch_combine(const CombineSendParams& send, const CombineRecvParams& recv, cudaStream_t stream) {
  const dim3 receive = combine_recv_grid(recv, kThreads);
  const CombineFusedParams p{send, recv, combine_send_grid(send), static_cast<int32_t>(receive.x)};
  low_latency_per_rank_combine_fused_kernel<<<p.senders + static_cast<int>(receive.x * receive.y), kThreads, 0,
                                              stream>>>(p);
  return launched("low-latency combine (per_rank)");
}

}  // namespace jax_ep::low_latency::per_rank
