// Block-wide routing layout: rank membership, per-rank and per-expert counts and (optionally) send positions.
// Shared by the standalone layout kernel (layout_kernels.cu) and the dispatch notify kernel (normal_kernels.cu).
#pragma once

#include <cstdint>

#include "jax_ep/constants.h"
#include "jax_ep/layout_params.h"

namespace jax_ep::layout {

// Ranks whose ballots, scan and positions are done together: per tile, the ranks are taken in chunks of this many,
// so the per-warp counts stay 8 KB of shared memory whatever R is.
constexpr int kRankChunk = 64;
constexpr int kMaskWords = (kMaxGroupRanks + 63) / 64;

// Scratch the caller provides in shared memory, for blocks of kThreads threads.
template <int kThreads>
struct TileSmem {
  int32_t warp_count[kThreads / 32][kRankChunk];  // per tile and rank chunk: tokens of each warp sent to each rank
  int32_t rank_base[kMaxGroupRanks];              // running count per rank over the tiles done
};
using BlockSmem = TileSmem<kLayoutThreads>;

// A token's rank set as kWords 64-bit words, every index into them a compile-time constant (the selects below). With
// one word (R <= 64, every NVLink group) the set stays in registers; wider sets (R > 64, the NVSHMEM kernels) the
// compiler still turns into indexed local memory.
template <int kWords>
struct RankSet {
  uint64_t w[kWords];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0;
  }
  __device__ __forceinline__ void add(int r) {
    const uint64_t bit = uint64_t{1} << (r & 63);
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] |= (r >> 6) == i ? bit : uint64_t{0};
  }
  __device__ __forceinline__ bool has(int r) const {
    uint64_t word = 0;
#pragma unroll
    for (int i = 0; i < kWords; ++i) word |= (r >> 6) == i ? w[i] : uint64_t{0};
    return (word >> (r & 63)) & 1u;
  }
};

// Zeroes what range_layout accumulates into: s_expert [E] and sm.rank_base [R]. Every thread of the block.
template <int kThreads>
__device__ __forceinline__ void clear_layout_counts(const Params& p, TileSmem<kThreads>& sm, int32_t* s_expert) {
  for (int e = threadIdx.x; e < p.num_experts; e += kThreads) s_expert[e] = 0;
  for (int r = threadIdx.x; r < p.num_ranks; r += kThreads) sm.rank_base[r] = 0;
  __syncthreads();
}

// Layout of tokens [begin, end) by all kThreads threads of one block: per-rank counts added to sm.rank_base,
// per-expert counts to s_expert ([E] s32 in shared memory), send_pos[t, r] = sm.rank_base[r] at the call + the
// position of t among the range's tokens sent to r (else -1), is_token_in_rank when asked.
// NOTE: tokens are taken in tiles of kThreads, one per thread, so a warp ballot + a scan over the warp counts gives
// each token its position among the tokens sent to a rank in token order (SPEC: rows by token index). A token's ids
// live in registers (the top-k loop is unrolled to kMaxTopk), its rank set too with one word (RankSet).
template <int kThreads, int kWords>
__device__ inline void range_layout_words(const Params& p, int begin, int end, TileSmem<kThreads>& sm,
                                          int32_t* s_expert) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kWarps = kThreads / 32;
  const int K = p.num_topk, E = p.num_experts, R = p.num_ranks;
  const int L = E / R;
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int tile = begin; tile < end; tile += kThreads) {
    const int t = tile + tid;
    const bool valid = t < end;
    RankSet<kWords> ranks;
    ranks.clear();
    if (valid) {
      const int32_t* row = p.topk_idx + static_cast<int64_t>(t) * K;
      int32_t ids[kMaxTopk];
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) ids[k] = k < K ? __ldg(row + k) : -1;
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        const int32_t r = k < K ? rank_of_expert(ids[k], E, L) : -1;
        if (r < 0) continue;
        ranks.add(r);
        if (!repeats_earlier(ids, k)) atomicAdd(&s_expert[ids[k]], 1);  // k is a constant here: ids stay registers
      }
      if (p.is_token_in_rank != nullptr)
        for (int r = 0; r < R; ++r) p.is_token_in_rank[static_cast<int64_t>(t) * R + r] = ranks.has(r);
    }
    for (int first = 0; first < R; first += kRankChunk) {
      const int n = R - first < kRankChunk ? R - first : kRankChunk;
      for (int i = 0; i < n; ++i) {
        const unsigned b = __ballot_sync(0xffffffffu, ranks.has(first + i));
        if (lane == 0) sm.warp_count[warp][i] = __popc(b);
      }
      __syncthreads();
      if (tid < n) {  // exclusive scan over the warps of this tile, continuing from earlier tiles
        int32_t running = sm.rank_base[first + tid];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const int32_t c = sm.warp_count[w][tid];
          sm.warp_count[w][tid] = running;
          running += c;
        }
        sm.rank_base[first + tid] = running;
      }
      __syncthreads();
      if (p.send_pos != nullptr) {
        for (int i = 0; i < n; ++i) {
          const bool bit = ranks.has(first + i);
          const unsigned b = __ballot_sync(0xffffffffu, bit);
          if (valid)
            p.send_pos[static_cast<int64_t>(t) * R + first + i] = bit ? sm.warp_count[warp][i] + __popc(b & lt_mask)
                                                                      : -1;
        }
      }
      __syncthreads();  // warp_count is rewritten by the next chunk or tile
    }
  }
}

// range_layout_words with one word of rank set where R <= 64 (every NVLink group), else words for kMaxGroupRanks.
template <int kThreads>
__device__ inline void range_layout(const Params& p, int begin, int end, TileSmem<kThreads>& sm, int32_t* s_expert) {
  if (p.num_ranks <= 64)
    range_layout_words<kThreads, 1>(p, begin, end, sm, s_expert);
  else
    range_layout_words<kThreads, kMaskWords>(p, begin, end, sm, s_expert);
}

// The whole layout of a rank's tokens by one block of kLayoutThreads threads.
__device__ inline void block_layout(const Params& p, BlockSmem& sm, int32_t* s_expert) {
  clear_layout_counts<kLayoutThreads>(p, sm, s_expert);
  range_layout<kLayoutThreads>(p, 0, p.num_tokens, sm, s_expert);
}

}  // namespace jax_ep::layout
