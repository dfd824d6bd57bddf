// Device code of the normal mode shared by its two kernel sets: the NVLink kernels (normal_kernels.cu, every rank by
// stores through peer pointers) and the NVSHMEM kernels (nvshmem/device/normal_send.cu, remote ranks by puts).
// Each function here does the transport-free part of a step: the routing layout and the handle counts of dispatch's
// notify, the staging rows of a token, the stores of a token's row to the destinations given, the stores of one
// combine row. Both kernel sets fill the same staging layout, so the receive side (copy-out, reduce) is one.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/ptx.cuh"
#include "common/layout.cuh"
#include "common/thread.cuh"
#include "jax_ep/normal_params.h"
#include "transport/peer.cuh"

namespace jax_ep::normal {

constexpr int kSendThreads = 512;  // 16 warps: one token (send) or one row (copy) per warp at a time
constexpr int kCopyThreads = 512;  // the local passes on every SM: copy-out, reduce
// Dispatch sender: 8 vectors in flight per lane (each load feeds ~R stores); an unroll of 4 and 1024-thread blocks
// measure the same (docs/log/2026-11-benchmark-runs.md).
constexpr int kSendUnroll = 8;
// Combine sender: 8 vectors in flight per lane (one store per load).
constexpr int kCombineUnroll = 8;

// The layout target's view of a dispatch's routing (send_pos out, no is_token_in_rank).
__device__ __forceinline__ layout::Params notify_layout_params(const DispatchParams& p) {
  layout::Params lp{};
  lp.topk_idx = p.topk_idx;
  lp.send_pos = p.send_pos;
  lp.num_tokens = p.num_tokens;
  lp.num_topk = p.num_topk;
  lp.num_experts = p.num_experts;
  lp.num_ranks = p.g.num_ranks;
  return lp;
}

// Dispatch notify of one block (the NVSHMEM kernels), before the barrier: the routing layout of this rank's tokens
// (send_pos, per-rank counts in sm.rank_base, per-expert counts in s_expert). Called by every thread of the block.
__device__ __forceinline__ void notify_layout(const DispatchParams& p, layout::BlockSmem& sm, int32_t* s_expert) {
  layout::block_layout(notify_layout_params(p), sm, s_expert);
  __syncthreads();
}

// first[0] + first[stride] + ... (count terms), loaded with ld.cg (counts peers or an earlier kernel wrote), the loads
// of kMaxNvlPeers terms at a time issued before any is added: one L2 round trip per kMaxNvlPeers terms, not per term.
__device__ __forceinline__ int32_t sum_strided_cg(const int32_t* first, int count, int stride) {
  int32_t total = 0;
  for (int base = 0; base < count; base += kMaxNvlPeers) {
    int32_t v[kMaxNvlPeers];
#pragma unroll
    for (int i = 0; i < kMaxNvlPeers; ++i) v[i] = base + i < count ? __ldcg(first + (base + i) * stride) : 0;
#pragma unroll
    for (int i = 0; i < kMaxNvlPeers; ++i) total += v[i];
  }
  return total;
}

// Dispatch notify of the NVSHMEM kernels, after every rank's counts have landed in this rank's counts /
// expert_counts regions: the handle counts and the receive totals (the NVLink notify adds them up in shared memory as
// the count words arrive). Called by every thread of the notify block; R entries of global memory per output.
__device__ __forceinline__ void notify_outputs(const DispatchParams& p) {
  const GroupCtx& g = p.g;
  const int tid = threadIdx.x, R = g.num_ranks, me = g.rank, L = p.num_experts / R;
  const char* self = self_base(g);
  const int32_t* counts = reinterpret_cast<const int32_t*>(self + g.layout.counts);  // [source s][destination d]
  for (int d = tid; d < R; d += blockDim.x) {
    p.recv_rank_counts[d] = __ldcg(counts + d * R + me);
    p.send_row_offset[d] = sum_strided_cg(counts + d, me, R);
  }
  if (tid == 0) *p.num_recv_tokens = sum_strided_cg(counts + me, R, R);
  const int32_t* expert_counts = reinterpret_cast<const int32_t*>(self + g.layout.expert_counts);
  for (int l = tid; l < L; l += blockDim.x) p.num_recv_tokens_per_expert[l] = sum_strided_cg(expert_counts + l, R, L);
}

// The staging row of token t on rank d (-1: not sent there, or cut by that rank's capacity); any lane, d < R.
// With chunked_send_pos, the one call for (t, d) also completes send_pos[t, d] (SendArgs).
__device__ __forceinline__ int32_t token_row(const SendArgs& a, int t, int d) {
  const int64_t at = static_cast<int64_t>(t) * a.g.num_ranks + d;
  int32_t sp;
  if (a.chunked_send_pos != nullptr) {
    // written by the notify kernel, rewritten here: plain loads, not the read-only path
    sp = a.chunked_send_pos[at];
    if (sp >= 0) {
      const int32_t* chunk_first = reinterpret_cast<const int32_t*>(self_base(a.g) + a.g.layout.notify_scratch);
      sp += __ldg(chunk_first + (t / a.chunk_tokens) * a.g.num_ranks + d);
      a.chunked_send_pos[at] = sp;
    }
  } else {
    sp = __ldg(a.send_pos + at);
  }
  if (sp < 0) return -1;
  const int32_t row = __ldg(a.send_row_offset + d) + sp;
  return row < a.capacity ? row : -1;
}

// token_row of ranks first .. first + kSlots - 1, for the whole warp: rows[d] is rank first + d's (-1 past R; lane d
// computes it). kSlots sizes the caller's register array: kMaxNvlPeers on the NVLink path (R <= 8, first = 0),
// kWideSlots on the NVSHMEM path when R > 8 (one call per chunk of 32 ranks).
constexpr int kWideSlots = 32;
template <int kSlots>
__device__ __forceinline__ void token_rows(const SendArgs& a, int t, int first, int32_t* rows) {
  static_assert(kSlots <= 32, "one lane per rank");
  const int lane = lane_id();
  const int my_row = lane < kSlots && first + lane < a.g.num_ranks ? token_row(a, t, first + lane) : -1;
#pragma unroll
  for (int d = 0; d < kSlots; ++d) rows[d] = __shfl_sync(0xffffffffu, my_row, d);
}

// The destination's view of a top-k entry (global expert e, weight w) of a token (SPEC): its local expert id where
// the expert lives on rank d, else -1 with weight 0. Without ids (cached dispatch: has_ids false) the weight as is.
__device__ __forceinline__ void local_entry_of(int32_t e, float w, bool has_ids, int d, int experts_per_rank,
                                               int num_ranks, int32_t* id, float* w_out) {
  *w_out = w;
  *id = -1;
  if (!has_ids) return;
  if (!layout::valid_expert(e, experts_per_rank * num_ranks)) e = -1;
  *id = (e >= 0 && e / experts_per_rank == d) ? e - d * experts_per_rank : -1;
  if (*id < 0) *w_out = 0.0f;
}

// local_entry_of for top-k entry k of token t of this rank's inputs.
__device__ __forceinline__ void local_entry(const SendArgs& a, int t, int k, int d, int32_t* id, float* w) {
  const int64_t at = static_cast<int64_t>(t) * a.num_weights + k;
  const bool has_ids = a.topk_idx != nullptr;
  local_entry_of(has_ids ? __ldg(a.topk_idx + at) : -1, __ldg(a.weights + at), has_ids, d, a.experts_per_rank,
                 a.g.num_ranks, id, w);
}

// One warp: a row of n16 16-byte vectors from `src` into dst_of(d) for every d < kSlots with rows[d] >= 0 except
// d == skip, each vector loaded once (kSendUnroll in flight per lane) and stored to every destination.
template <int kSlots, class DstOf>
__device__ __forceinline__ void fan_out_row(const int4* src, int n16, const int32_t* rows, DstOf dst_of,
                                            int skip = -1) {
  const int lane = lane_id();
  for (int base = 0; base < n16; base += 32 * kSendUnroll) {
    int4 v[kSendUnroll];
#pragma unroll
    for (int j = 0; j < kSendUnroll; ++j) {
      const int i = base + j * 32 + lane;
      if (i < n16) v[j] = ld_nc_v4(src + i);
    }
#pragma unroll
    for (int d = 0; d < kSlots; ++d) {
      if (rows[d] < 0 || d == skip) continue;
      int4* dst = dst_of(d);
#pragma unroll
      for (int j = 0; j < kSendUnroll; ++j) {
        const int i = base + j * 32 + lane;
        if (i < n16) st_v4(dst + i, v[j]);
      }
    }
  }
}

// A rank's RecvTargets entry (peer-written: L1-bypassing loads) into `out`; one thread.
__device__ __forceinline__ void load_recv_targets(const char* entry, RecvTargets* out) {
  static_assert(sizeof(RecvTargets) % 16 == 0, "loaded as 16-byte vectors");
  const int4* src = reinterpret_cast<const int4*>(entry);
  int4* dst = reinterpret_cast<int4*>(out);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(RecvTargets) / 16); ++i) dst[i] = ld_cg_v4(src + i);
}

// The arrays one destination's rows of a token go to: its staging regions, or the outputs it published (direct
// receive); row r of each array belongs to received row r either way.
struct RowDest {
  char* rows;
  float* scales;
  int32_t* topk_idx;
  float* weights;
  int32_t* src_idx;
  int32_t* src_rank;  // direct receive only (the copy-out writes it otherwise)
};

__device__ __forceinline__ RowDest row_dest(const GroupCtx& g, int q, const RecvTargets* target) {
  if (target != nullptr && target->rows != nullptr)
    return {target->rows, target->scales, target->topk_idx, target->weights, target->src_idx, target->src_rank};
  const BufferLayout& B = g.layout;
  char* base = g.peers.base[q];
  return {base + B.payload, reinterpret_cast<float*>(base + B.scales), reinterpret_cast<int32_t*>(base + B.topk_idx),
          reinterpret_cast<float*>(base + B.topk_weights), reinterpret_cast<int32_t*>(base + B.src_idx), nullptr};
}

// Stores token t (row, scales, top-k ids and weights, source index) into row rows[d] of every rank first + d with
// rows[d] >= 0: its staging through g.peers.base[first + d], or with targets != nullptr (direct receive, first = 0)
// the outputs targets[d] names where it names any. One warp, 16-byte vectors, each loaded once and stored to every
// destination. The caller clears rows[d] of ranks it reaches otherwise (puts). rows: kSlots entries (token_rows of
// the same first). With a.self_rows_from_inputs this rank's own row gets no payload or scales (the copy-out reads
// them from the inputs), only the rest.
template <int kSlots>
__device__ __forceinline__ void store_token(const SendArgs& a, int t, int first, const int32_t* rows,
                                            const RecvTargets* targets = nullptr) {
  const GroupCtx& g = a.g;
  const int lane = lane_id();
  auto dest = [&](int d) { return row_dest(g, first + d, targets != nullptr ? targets + d : nullptr); };
  const int skip = a.self_rows_from_inputs ? g.rank - first : -1;  // this rank's slot: no payload, no scales
  fan_out_row<kSlots>(reinterpret_cast<const int4*>(a.rows + static_cast<int64_t>(t) * a.row_bytes), a.row_bytes / 16,
                      rows, [&](int d) {
                        return reinterpret_cast<int4*>(dest(d).rows + static_cast<int64_t>(rows[d]) * a.row_bytes);
                      }, skip);
  for (int j = lane; j < a.scale_cols; j += 32) {
    const float s = __ldg(a.scales + static_cast<int64_t>(t) * a.scale_cols + j);
#pragma unroll
    for (int d = 0; d < kSlots; ++d)
      if (rows[d] >= 0 && d != skip) dest(d).scales[static_cast<int64_t>(rows[d]) * a.scale_cols + j] = s;
  }
  if (lane < a.num_weights) {
    const int k = lane, K = a.num_weights;
#pragma unroll
    for (int d = 0; d < kSlots; ++d) {
      if (rows[d] < 0) continue;
      int32_t id;
      float w;
      local_entry(a, t, k, first + d, &id, &w);
      const int64_t at = static_cast<int64_t>(rows[d]) * K + k;
      const RowDest to = dest(d);
      if (a.topk_idx != nullptr) to.topk_idx[at] = id;
      to.weights[at] = w;
    }
  }
  if (a.write_src_idx && lane == 0) {
#pragma unroll
    for (int d = 0; d < kSlots; ++d) {
      if (rows[d] < 0) continue;
      const RowDest to = dest(d);
      to.src_idx[rows[d]] = t;
      if (to.src_rank != nullptr) to.src_rank[rows[d]] = g.rank;
    }
  }
}

// Copies `bytes` (a multiple of 16) from src to dst with one warp, kCombineUnroll vectors in flight per lane.
__device__ __forceinline__ void warp_copy_row(int4* dst, const int4* src, int bytes) {
  const int n16 = bytes / 16, lane = lane_id();
  for (int base_i = 0; base_i < n16; base_i += 32 * kCombineUnroll) {
    int4 v[kCombineUnroll];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int i = base_i + u * 32 + lane;
      if (i < n16) v[u] = ld_nc_v4(src + i);
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int i = base_i + u * 32 + lane;
      if (i < n16) st_v4(dst + i, v[u]);
    }
  }
}

// Combine values of one 16-byte vector (kN elements of Elem: bf16 or f32) added into f32 accumulators, and packed
// back.
template <typename Elem>
struct Pack;
template <>
struct Pack<__nv_bfloat16> {
  static constexpr int kN = 8;
  __device__ static void add(float* acc, const int4& v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float* acc) { return pack_bf16x8(acc); }
};
template <>
struct Pack<float> {
  static constexpr int kN = 4;
  __device__ static void add(float* acc, const int4& v) {
    const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += f[i];
  }
  __device__ static int4 pack(const float* acc) {
    int4 v;
    float* f = reinterpret_cast<float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = acc[i];
    return v;
  }
};

// Whether a sender block of a two-role kernel (send_copy_kernel, combine_push_kernel), done with its sends, may join
// the receiving blocks: only once every sender block has taken its role (the role ticket, which only grows until the
// grid's last block resets it, has reached `senders`). A joined block may spin; before then it could hold the SM a
// sender not yet started needs (kernels on other streams may hold the others) while waiting for that sender's rows.
// Every thread of the block, which must be a sender; the answer is the same for all of them.
__device__ __forceinline__ bool every_sender_started(char* self, int senders, int32_t* s_answer) {
  __syncthreads();  // no thread still reads *s_answer
  if (threadIdx.x == 0)
    *s_answer = *reinterpret_cast<volatile uint32_t*>(header_word(self, SignalHeader::kRoleTicket)) >=
                static_cast<uint32_t>(senders);
  __syncthreads();
  return *s_answer != 0;
}

// The arrival counter of (rank `from`'s rows, chunk c) in the staging at `base` (signal_header.h: kRowArrivals).
__device__ __forceinline__ uint32_t* row_arrivals(char* base, int from, int c) {
  return header_word(base, SignalHeader::kRowArrivals + 4 * (static_cast<int64_t>(from) * kArrivalChunks + c));
}

// Pause between two reads of an arrival counter that was not yet complete: a receiving warp that polls without one
// slows the senders' NVLink stores of the same GPU (measured: docs/BENCHMARKS.md, "Where the time goes").
constexpr uint32_t kArrivalBackoffNs = 500;

// Combine, every thread of a block: the rows [s_begin[s], s_end[s]) of staging that came from rank s (the handle's
// recv_rank_counts, cut by the capacity) and s_span = the most rows of any other rank. Shared-memory outputs.
__device__ __forceinline__ void combine_source_spans(const CombineParams& p, int32_t* s_begin, int32_t* s_end,
                                                     int32_t* s_span) {
  for (int s = threadIdx.x; s < p.g.num_ranks; s += blockDim.x) s_end[s] = p.recv_rank_counts[s];  // loads at once
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t off = 0, span = 0;
    for (int s = 0; s < p.g.num_ranks; ++s) {
      const int32_t n = s_end[s];
      s_begin[s] = min(off, p.capacity);  // rows past the capacity never arrived
      s_end[s] = min(off + n, p.capacity);
      if (s != p.g.rank) span = max(span, s_end[s] - s_begin[s]);
      off += n;
    }
    *s_span = span;
  }
  __syncthreads();
}

// Combine: the received row `row` of the source rank, its (rank, token) checked, or -1 for padding / a row the
// handle does not attribute to `from` (a handle from dispatch always has recv_src_rank[row] == from).
__device__ __forceinline__ int32_t combine_row_token(const CombineParams& p, int32_t row, int from) {
  const int32_t s = __ldg(p.recv_src_rank + row), t = __ldg(p.recv_src_idx + row);
  if (s < 0 || s >= p.g.num_ranks || t < 0 || t >= p.max_tokens_per_rank || s != from) return -1;
  return t;
}

// Combine's push slot of (pushing rank `rank`, token t) in a source's staging (staging_layout.h combine_slot_rows):
// [rank][t], or [rank's local index][t] in a forwarding group (only the source's node pushes there).
__device__ __forceinline__ int64_t combine_slot(const GroupCtx& g, int rank, int32_t t, int32_t max_tokens_per_rank) {
  const int r = g.forward_nvl > 0 ? rank % g.forward_nvl : rank;
  return static_cast<int64_t>(r) * max_tokens_per_rank + t;
}

// Combine, one warp: received row `row` (values and its Kw weights) into slot `slot` (combine_slot) of the staging
// at `base` (the source's buffer, as this device addresses it).
__device__ __forceinline__ void store_combine_row(const CombineParams& p, char* base, int64_t slot, int32_t row) {
  const BufferLayout& B = p.g.layout;
  const int lane = lane_id();
  warp_copy_row(reinterpret_cast<int4*>(base + B.payload + slot * p.row_bytes),
                reinterpret_cast<const int4*>(static_cast<const char*>(p.values) + static_cast<int64_t>(row) *
                                              p.row_bytes),
                p.row_bytes);
  if (lane < p.num_weights)
    reinterpret_cast<float*>(base + B.topk_weights)[slot * p.num_weights + lane] =
        __ldg(p.weights + static_cast<int64_t>(row) * p.num_weights + lane);
}

}  // namespace jax_ep::normal
