// Normal-mode combine on the NVLink kernels (launched by normal_kernels.cu's launch_combine): publish + barrier; push
// mode: one kernel whose sender blocks send each received row back to its source while its reducer blocks sum the
// rows as they land; pull mode: the reduction reading the peers' inputs, then the one-warp wait. The reduction also
// serves the NVSHMEM kernels' push mode (from staging, after their wait). normal_kernels.cu's header comment has the
// op's sequence.
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

// Pull combine's wait (one warp, never inside a wide kernel: see wait_data_kernel), after the reduce: every rank has
// finished reading this rank's inputs, which XLA may reuse once the op ends. In push mode it returns at once.
__global__ void __launch_bounds__(32, 1) combine_wait_kernel(const __grid_constant__ CombineParams p) {
  if (!pull_mode(p)) return;
  const GroupCtx& g = p.g;
  const uint32_t epoch = current_epoch(g);
  for (int s = threadIdx.x; s < g.num_ranks; s += blockDim.x)
    wait_peer(g, s, SignalHeader::kDataFlag, epoch, "combine (peers reading this rank's values)");
}

// ---------------------------------------------------------------------------------------------------------------
// y[t] for the columns of chunk c (kReduceVecs 16-byte vectors: 4 per lane, 2 KB of bf16) = the sum over ranks r
// (ascending) that kept token t of r's term, accumulated in f32. r's term is the row of token t in r's `values` (row
// send_row_offset[r] + send_pos[t, r]: where dispatch placed the token on r):
//   - r == this rank: read from `values` here;
//   - pull mode: read from r's `values` through the peer mapping (s_src[r], its CombineSource);
//   - push mode: r's slot of token t in the staging (combine_slot), where r's send copied it; with chunk_rows > 0
//     (combine_push_kernel) lane r first waits until r's chunk of rows holding the token is complete
//     (row_arrivals), else every rank's rows are in already (the NVSHMEM kernels' send and wait ran before);
//     node-first combine: a remote node's ranks are one term, its partial row in fwd_rows.
// Every way reads the same numbers in the same order, so the result does not depend on the mode. One warp. Per lane,
// all loads of a rank are issued before its adds; ranks are summed in ascending order (the order the reference uses),
// so the result does not depend on the chunking.
constexpr int kReduceVecs = 128;

template <typename Elem>
__device__ __forceinline__ void reduce_item(const CombineParams& p, int t, int c, bool pull, const CombineSource* s_src,
                                            int chunk_rows, uint32_t backoff_ns = 0) {
  using P = Pack<Elem>;
  constexpr int kU = kReduceVecs / 32;  // vectors per lane per item
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int R = g.num_ranks, me = g.rank, lane = lane_id(), nvl = g.forward_nvl;
  char* self = self_base(g);
  const int n16 = p.row_bytes / 16;
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
      // q's row of this token is its sp-th row for this rank (its rows for this rank follow send_pos)
      // (clamped: a handle not from dispatch may hold sp >= T_max; its wait then times out instead of reading past
      // the counters)
      if (chunk_rows > 0 && kept && q != me)
        wait_reached(row_arrivals(self, q, min(sp / chunk_rows, kArrivalChunks - 1)),
                     static_cast<uint32_t>(chunk_rows), g.timeout_ns, "combine (rows from peers)", me, q, backoff_ns);
    }
    if (chunk_rows > 0) __syncwarp();  // orders each waiting lane's acquire before every lane's loads below
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
        const int64_t slot = combine_slot(g, r, t, p.max_tokens_per_rank);
        const int4* src = reinterpret_cast<const int4*>(self + B.payload + slot * p.row_bytes);
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (base + 32 * u < n16) v[u] = ld_cg_v4(src + base + 32 * u);
        if (with_weights)
          wacc += __ldcg(reinterpret_cast<const float*>(self + B.topk_weights) + slot * p.num_weights + lane);
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

// Reduce items: (token, chunk of kReduceVecs vectors), token-major, taken by the warps of `q` one at a time
// (next_item), so a small T still fills the SMs (one warp per token left ~T/16 blocks busy). joined: a block that is
// not one of q's (a push-combine sender done with its sends) takes only items past q's static first round.
template <typename Elem>
__device__ __forceinline__ void reduce_items(const CombineParams& p, const ItemQueue& q, bool pull,
                                             const CombineSource* s_src, int chunk_rows, uint32_t backoff_ns = 0,
                                             bool joined = false) {
  const int chunks = (p.row_bytes / 16 + kReduceVecs - 1) / kReduceVecs;
  const int items = p.num_tokens * chunks;  // < 2^31: T <= max_tokens_per_rank, chunks <= H / 512
  for (int item = joined ? static_cast<int>(next_item(q, items)) : first_item(q); item < items;
       item = static_cast<int>(next_item(q, items))) {
    const int t = item / chunks;
    reduce_item<Elem>(p, t, item - t * chunks, pull, s_src, chunk_rows, backoff_ns);
  }
}

// Combine's reduce as its own kernel: pull mode (the NVLink kernels, after the barrier; the last block then tells
// every rank this rank is done reading its inputs), or push mode after the NVSHMEM kernels' send and wait.
// pull_only: the NVLink launch, where push mode reduces in combine_push_kernel and this kernel returns at once.
template <typename Elem>
__global__ void __launch_bounds__(kCopyThreads) combine_reduce_kernel(const __grid_constant__ CombineParams p,
                                                                      bool pull_only) {
  const GroupCtx& g = p.g;
  const bool pull = pull_mode(p);
  if (pull_only && !pull) return;
  phase_begin(g_normal_phases);
  // every rank's CombineSource in pull mode (R <= kMaxNvlPeers: the NVLink kernels), else only this rank's inputs
  __shared__ CombineSource s_src[kMaxNvlPeers];
  if (pull) {
    const char* table = combine_sources(self_base(g), current_epoch(g));
    for (int r = threadIdx.x; r < g.num_ranks; r += blockDim.x) {
      s_src[r].values = reinterpret_cast<const char*>(
          __ldcg(reinterpret_cast<const unsigned long long*>(table + r * SignalHeader::kCombineSourceBytes)));
      s_src[r].weights = reinterpret_cast<const float*>(
          __ldcg(reinterpret_cast<const unsigned long long*>(table + r * SignalHeader::kCombineSourceBytes + 8)));
    }
    __syncthreads();
  }
  reduce_items<Elem>(p, grid_items(g), pull, s_src, 0);
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseReduceBlockDone);
  if (pull ? finish_and_signal_data(g, current_epoch(g)) : last_items_block(g))
    phase_stamp(g_normal_phases, kPhaseReduceLastBlockDone);
}

// ---------------------------------------------------------------------------------------------------------------
// Push combine over NVLink, one kernel: `senders` blocks send, the others reduce as the rows land (the reduce of a
// token waits only for the chunks of rows that hold it, so it runs under the sends instead of after them).
//
// Senders: every received row from a remote rank s goes back to s, into s's slot (this rank, source token); a warp
// takes 1 to kMaxRowsPerItem consecutive rows of one source per item and adds them to s's arrival counters of their
// chunks (one red.release.sys per chunk touched: cumulative over the warp's stores, which __syncwarp orders before
// it). Rows from this rank itself are not copied: the reduce reads them
// straight from `values`. Row order: received rows are grouped by source rank; taking them in that order made every
// warp of every rank write to the same destination at the same time, so warps interleave the remote sources instead:
// item j -> source (me + 1 + j % (R-1)) % R, k-th row of that source with k = j / (R-1) (consecutive warps write to
// different peers, the rotation by `me` makes the ranks start on different destinations, and each source's rows are
// taken in ascending k, so its chunks complete roughly in order).
// Reducers: reduce_items with the arrival waits (reduce_item), tokens in ascending order. A sender block joins the
// reducers once its sends are done and every sender has started (every_sender_started), taking only items past their
// static first round.
//
// NOTE (progress): reducer blocks spin, so every sender block of this kernel must run: roles go by the order in which
// blocks start (a ticket), not by blockIdx, so the first blocks resident are the senders, and a block that spins has
// seen every sender start (a joined sender checks it: every_sender_started); senders never wait for anything before
// their sends are done, so every chunk a reducer waits for completes. The grid (two_role_grid: num_sms senders and
// max(2 num_sms, 24) reducers) is at most one wave; at the default num_sms it holds 72 of an H100's 132 SMs, so kernels
// on other streams of this GPU still find SMs while the reducers wait.
constexpr int kMaxRowsPerItem = 4;

template <typename Elem>
__global__ void __launch_bounds__(kSendThreads) combine_push_kernel(const __grid_constant__ CombineParams p,
                                                                    int senders) {
  __shared__ int32_t s_begin[kMaxGroupRanks], s_end[kMaxGroupRanks], s_span, s_role, s_last, s_join;
  const GroupCtx& g = p.g;
  if (pull_mode(p)) return;  // the reduce kernel pulls the rows
  phase_begin(g_normal_phases);
  const int R = g.num_ranks, me = g.rank, lane = lane_id();
  char* self = self_base(g);
  const int chunk_rows = arrival_chunk_rows(p.max_tokens_per_rank);
  if (threadIdx.x == 0) s_role = static_cast<int32_t>(atomicAdd(header_word(self, SignalHeader::kRoleTicket), 1u));
  __syncthreads();
  const int role = s_role;
  if (role < senders) {
    combine_source_spans(p, s_begin, s_end, &s_span);
    const ItemQueue q{header_word(self, SignalHeader::kNextItem), senders, role};
    const int num_src = R - 1;  // R == 1: nothing to send
    // rows per item: 1 while each warp has few rows (the last items set the tail), up to kMaxRowsPerItem when many
    // (one release per item instead of per row: a release waits for the warp's stores, which costs few SMs most)
    const int64_t rows_per_warp = static_cast<int64_t>(num_src) * s_span / (static_cast<int64_t>(senders) * num_warps());
    const int per = static_cast<int>(max(int64_t{1}, min(int64_t{kMaxRowsPerItem}, rows_per_warp / 8)));
    const int64_t total = static_cast<int64_t>(num_src) * ((s_span + per - 1) / per);
    for (int64_t j = first_item(q); j < total; j = next_item(q, total)) {
      const int from = (me + 1 + static_cast<int>(j % num_src)) % R;
      // a source sends this rank at most T_max rows (one per token): more means a handle not from dispatch, whose
      // extra rows are not sent (their chunks would lie past kArrivalChunks)
      const int32_t k0 = static_cast<int32_t>(j / num_src) * per,
                    n = min(s_end[from] - s_begin[from], p.max_tokens_per_rank);
      int pending_c = -1;
      uint32_t pending = 0;
      for (int32_t k = k0; k < k0 + per && k < n; ++k) {
        const int c = k / chunk_rows;
        if (c != pending_c && pending != 0) {
          __syncwarp();
          if (lane == 0) red_add_release_sys(row_arrivals(peer_base(g, from), me, pending_c), pending);
          pending = 0;
        }
        pending_c = c;
        const int32_t row = s_begin[from] + k;
        const int32_t t = combine_row_token(p, row, from);
        if (t >= 0) store_combine_row(p, peer_base(g, from), combine_slot(g, me, t, p.max_tokens_per_rank), row);
        // the source's last row completes its chunk: it adds the rows the chunk does not have
        pending += 1u + (k == n - 1 ? static_cast<uint32_t>((c + 1) * chunk_rows - n) : 0u);
      }
      if (pending != 0) {
        __syncwarp();
        if (lane == 0) red_add_release_sys(row_arrivals(peer_base(g, from), me, pending_c), pending);
      }
    }
    __syncthreads();
    phase_stamp(g_normal_phases, kPhaseCombineSendBlockDone);
  }
  // Reducers from the start; a sender block, once its sends are done and every sender has started, takes the items
  // past the reducers' static first round
  const bool reducer = role >= senders;
  const ItemQueue q{header_word(self, SignalHeader::kNextReceiveItem), static_cast<int>(gridDim.x) - senders,
                    reducer ? role - senders : 0};
  if (reducer || every_sender_started(self, senders, &s_join))
    reduce_items<Elem>(p, q, false, nullptr, chunk_rows, kArrivalBackoffNs, !reducer);
  __syncthreads();
  phase_stamp(g_normal_phases, kPhaseReduceBlockDone);
  // The last block: every block that reduced has seen every chunk it needed complete, so every row of this op has
  // arrived and every arrival counter of this rank can go back to 0 (no peer adds again before the next combine's
  // barrier).
  if (!last_block<TicketScope::kGpu>(header_word(self, SignalHeader::kBlockDone), &s_last)) return;
  if (threadIdx.x == 0) {
    *header_word(self, SignalHeader::kNextItem) = 0u;
    *header_word(self, SignalHeader::kNextReceiveItem) = 0u;
    *header_word(self, SignalHeader::kRoleTicket) = 0u;
  }
  const int used = (p.max_tokens_per_rank + chunk_rows - 1) / chunk_rows;
  for (int i = threadIdx.x; i < R * used; i += blockDim.x) *row_arrivals(self, i / used, i % used) = 0u;
  phase_stamp(g_normal_phases, kPhaseReduceLastBlockDone);
}

}  // namespace
}  // namespace jax_ep::normal
