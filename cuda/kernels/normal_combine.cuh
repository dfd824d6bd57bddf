// Normal-mode combine on the NVLink kernels (launched by normal_kernels.cu's launch_combine): publish + barrier,
// push-mode send of each received row back to its source, the one-warp waits, and the reduction (push: from staging;
// pull: from the peers' inputs). normal_kernels.cu's header comment has the op's sequence.
// NOTE: for the one translation unit of the normal-mode kernels (normal_kernels.cu): kernels with internal linkage.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/copy.cuh"
#include "common/ptx.cuh"
#include "common/thread.cuh"
#include "jax_ep/normal_params.h"
#include "jax_ep/signal_header.h"
#include "kernels/normal_device.cuh"
#include "kernels/normal_phases.cuh"
#include "transport/peer.cuh"

namespace jax_ep::normal {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The combine-source table of the op with this epoch in `base`'s signal header (signal_header.h: by parity).
__device__ __forceinline__ char* combine_sources(char* base, uint32_t epoch) {
  return base + SignalHeader::kCombineSources + (epoch & 1u) * kMaxNvlPeers * SignalHeader::kCombineSourceBytes;
}

// Combine step 0 (NVLink kernels, one warp): this rank's CombineSource into every rank's table of this op (epoch =
// the one the barrier below completes), then the barrier (whose release stores order the table before any rank
// reads it).
__global__ void __launch_bounds__(32, 1) combine_publish_barrier_kernel(const __grid_constant__ CombineParams p) {
  const GroupCtx& g = p.g;
  CombineSource mine{};
  if (p.publish) {
    mine.values = static_cast<const char*>(p.values);
    mine.weights = p.weights;
  }
  for (int d = threadIdx.x; d < g.num_ranks; d += blockDim.x)
    *reinterpret_cast<CombineSource*>(combine_sources(peer_base(g, d), current_epoch(g) + 1) +
                                      g.rank * SignalHeader::kCombineSourceBytes) = mine;
  // thread d's release arrival at rank d (group_barrier_block) orders its store above
  phase_begin(g_normal_phases);
  group_barrier_block(g, "combine barrier");
  phase_stamp(g_normal_phases, kPhaseCombineBarrier);
}

// Pull mode of this combine (normal_params.h: CombineSource): every rank published its inputs. Any thread, after
// the op's barrier; every thread of the group computes the same answer from the same table.
__device__ __forceinline__ bool pull_mode(const CombineParams& p) {
  if (!p.pull_table) return false;
  const char* table = combine_sources(self_base(p.g), current_epoch(p.g));
  for (int r = 0; r < p.g.num_ranks; ++r)
    if (__ldcg(reinterpret_cast<const unsigned long long*>(table + r * SignalHeader::kCombineSourceBytes)) == 0ull)
      return false;
  return true;
}

// Combine's one wait (one warp, never inside a wide kernel: see wait_data_kernel): in push mode before the reduce
// (every rank's rows are in this rank's staging), in pull mode after it (every rank has finished reading this
// rank's inputs, which XLA may reuse once the op ends). The other launch returns at once.
__global__ void __launch_bounds__(32, 1) combine_wait_kernel(const __grid_constant__ CombineParams p, bool after_reduce) {
  if (pull_mode(p) != after_reduce) return;
  const GroupCtx& g = p.g;
  const uint32_t epoch = current_epoch(g);
  for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x)
    wait_peer(g, s, SignalHeader::kDataFlag, epoch,
              after_reduce ? "combine (peers reading this rank's values)" : "receive (data from peers)");
}

// ---------------------------------------------------------------------------------------------------------------
// Combine step 1 (push mode): every received row from a remote rank s goes back to s, into s's slot
// [this rank][source token].
// Rows from this rank itself are not copied: step 2 reads them straight from `values` (row send_row_offset[me] +
// send_pos[t, me] is exactly the row that dispatch placed token t of this rank in).
//
// NOTE (row order): received rows are grouped by source rank ([prefix[s], prefix[s] + count[s]) holds rank s's
// rows). Taking them in that order made every warp of every rank write to the same destination at the same time
// (all ranks first send to rank 0, then to rank 1, ...): one GPU's NVLink ingress was the bottleneck while the
// others idled. Warps instead interleave the remote sources: virtual row j -> source (me + 1 + j % (R-1)) % R,
// k-th row of that source with k = j / (R-1), so consecutive warps write to different peers and the rotation by
// `me` makes the ranks start on different destinations.
__global__ void __launch_bounds__(kSendThreads) combine_send_kernel(const __grid_constant__ CombineParams p) {
  __shared__ int32_t s_begin[kMaxGroupRanks], s_end[kMaxGroupRanks], s_span;
  const GroupCtx& g = p.g;
  const int R = g.num_ranks, me = g.rank;
  if (pull_mode(p)) return;  // the sources read the rows themselves
  const uint32_t epoch = current_epoch(g);
  combine_source_spans(p, s_begin, s_end, &s_span);
  const int num_src = R - 1;  // R == 1: nothing to send
  const int64_t total = static_cast<int64_t>(num_src) * s_span;
  for (int64_t j = first_item(); j < total; j = next_item(g, total)) {
    const int from = (me + 1 + static_cast<int>(j % num_src)) % R;
    const int32_t row = s_begin[from] + static_cast<int32_t>(j / num_src);
    if (row >= s_end[from]) continue;  // this source has fewer rows
    const int32_t t = combine_row_token(p, row, from);
    if (t < 0) continue;  // padding (or a corrupted handle)
    store_combine_row(p, peer_base(g, from), static_cast<int64_t>(me) * p.max_tokens_per_rank + t, row);
  }
  finish_and_signal_data(g, epoch, true);
}

// Combine step 2: y[t] = sum over ranks r (ascending) that kept token t of r's term, accumulated in f32. r's term is
// the row of token t in r's `values` (row send_row_offset[r] + send_pos[t, r]: where dispatch placed the token on r):
//   - r == this rank: read from `values` here;
//   - pull mode (pull_mode(p)): read from r's `values` through the peer mapping (its CombineSource), after which the
//     last block tells every rank this rank is done reading (combine_wait_kernel waits for that);
//   - push mode (after combine_wait_kernel): slot [r][t] of the staging, where step 1 of r copied it; node-first
//     combine: a remote node's ranks are one term, its partial row in fwd_rows.
// Every way reads the same numbers in the same order, so the result does not depend on the mode.
// Work item = (token, chunk of kReduceVecs 16-byte vectors: 4 per lane, 2 KB of bf16), taken by the warps of the grid
// one at a time (next_item), so a small T still fills the SMs (one warp per token left ~T/16 blocks busy). Per lane,
// all loads of a rank are issued before its adds; ranks are summed in ascending order (the order the reference uses),
// so the result does not depend on the chunking.
constexpr int kReduceVecs = 128;

template <typename Elem>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(const __grid_constant__ CombineParams p) {
  using P = Pack<Elem>;
  constexpr int kU = kReduceVecs / 32;  // vectors per lane per item
  phase_begin(g_normal_phases);
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int R = g.num_ranks, me = g.rank, lane = lane_id(), nvl = g.forward_nvl;
  const char* self = self_base(g);
  const int n16 = p.row_bytes / 16;
  const int chunks = (n16 + kReduceVecs - 1) / kReduceVecs;
  const int64_t rank_stride = static_cast<int64_t>(p.max_tokens_per_rank);
  const int items = p.num_tokens * chunks;  // < 2^31: T <= max_tokens_per_rank, chunks <= H / 512
  // every rank's CombineSource in pull mode (R <= kMaxNvlPeers: the NVLink kernels), else only this rank's inputs
  __shared__ CombineSource s_src[kMaxNvlPeers];
  const bool pull = pull_mode(p);
  if (pull) {
    const char* table = combine_sources(self_base(g), current_epoch(g));
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      s_src[r].values = reinterpret_cast<const char*>(
          __ldcg(reinterpret_cast<const unsigned long long*>(table + r * SignalHeader::kCombineSourceBytes)));
      s_src[r].weights = reinterpret_cast<const float*>(
          __ldcg(reinterpret_cast<const unsigned long long*>(table + r * SignalHeader::kCombineSourceBytes + 8)));
    }
    __syncthreads();
  }

  for (int item = first_item(); item < items; item = static_cast<int>(next_item(g, items))) {
    const int t = item / chunks, c = item - t * chunks;
    const bool with_weights = c == 0 && lane < p.num_weights;
    int4* dst = reinterpret_cast<int4*>(static_cast<char*>(p.y) + static_cast<int64_t>(t) * p.row_bytes);
    const int base = c * kReduceVecs + lane;
    float acc[kU][P::kN];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
#pragma unroll
      for (int j = 0; j < P::kN; ++j) acc[u][j] = 0.0f;
    }
    float wacc = 0.0f;
    // The ranks that kept the token, in ascending order (the summation order the results are defined by), 32 per
    // ballot; with node-first combine (g.forward_nvl > 0) a remote node's ranks count once, as the partial row
    // (values' dtype) its forwarder put into fwd_rows [node][t], at the place of the node's first kept rank
    // (ranks ascend, so a node's later ranks find it in done_node).
    int done_node = -1;
    for (int first = 0; first < R; first += 32) {
      bool kept = false;
      if (first + lane < R) {
        const int q = first + lane;
        const int32_t sp = __ldg(p.send_pos + static_cast<int64_t>(t) * R + q);
        // A row cut by rank q's capacity never arrived there: it contributes 0 (its slot holds stale data).
        kept = sp >= 0 && __ldg(p.send_row_offset + q) + sp < p.capacity;
      }
      for (uint32_t m = __ballot_sync(0xffffffffu, kept); m != 0u; m &= m - 1u) {
        const int r = first + __ffs(m) - 1;
        int4 v[kU];
        if (nvl > 0 && r / nvl != me / nvl) {
          const int node = r / nvl;
          if (node == done_node) continue;
          done_node = node;
          const int64_t slot = forward_slot(B, node, me / nvl, t);
          const int4* src = reinterpret_cast<const int4*>(self + B.fwd_rows + slot * B.payload_stride);
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (base + 32 * u < n16) v[u] = ld_cg_v4(src + base + 32 * u);
          if (with_weights)
            wacc += __ldcg(reinterpret_cast<const float*>(self + B.fwd_meta + slot * B.fwd_stride + 4) + lane);
        } else if (r == me || pull) {
          // row of token t in r's `values`: every rank's values are its op's read-only input, so nothing writes them
          // while this kernel runs (a peer's stay valid until it has seen this rank's done signal)
          const char* values = r == me ? static_cast<const char*>(p.values) : s_src[r].values;
          const float* weights = r == me ? p.weights : s_src[r].weights;
          const int32_t row = __ldg(p.send_row_offset + r) + __ldg(p.send_pos + static_cast<int64_t>(t) * R + r);
          const int4* src = reinterpret_cast<const int4*>(values + static_cast<int64_t>(row) * p.row_bytes);
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (base + 32 * u < n16) v[u] = ld_nc_v4(src + base + 32 * u);
          if (with_weights) wacc += __ldg(weights + static_cast<int64_t>(row) * p.num_weights + lane);
        } else {
          const int4* src = reinterpret_cast<const int4*>(self + B.payload + (r * rank_stride + t) * p.row_bytes);
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (base + 32 * u < n16) v[u] = ld_cg_v4(src + base + 32 * u);
          if (with_weights)
            wacc += __ldcg(reinterpret_cast<const float*>(self + B.topk_weights) + (r * rank_stride + t) *
                                                                                       p.num_weights + lane);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (base + 32 * u < n16) P::add(acc[u], v[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (base + 32 * u < n16) dst[base + 32 * u] = P::pack(acc[u]);
    if (with_weights) p.y_weights[static_cast<int64_t>(t) * p.num_weights + lane] = wacc;
  }
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseReduceBlockDone);
  // pull: the last block tells every rank this rank is done reading its inputs
  if (pull ? finish_and_signal_data(g, current_epoch(g), true) : last_items_block(g))
    phase_stamp(g_normal_phases, kPhaseReduceLastBlockDone);
}

}  // namespace
}  // namespace jax_ep::normal
