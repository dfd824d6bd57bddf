// Low-latency mode (SPEC §4): dispatch into per-expert slots and weighted combine, each as a send kernel and a
// receive kernel (the two halves of the split custom calls), and as one kernel playing both (the fused ops).
//
//   dispatch send   low_latency_send.cuh (one template for both modes): one block per token, its row read (fp8: quantized)
//                   once and written once per distinct expert into the owner at slot [l][me][position]; the last
//                   block publishes every expert's (l, me) flag with its count inside. No count exchange, no
//                   barrier: positions are known locally, so the send never waits for a peer (except the rare "peer
//                   still reads op n-2" check).
//   dispatch recv   blocks (l, part): wait for the R flags of expert l, pack rows in (source, token) order into the
//                   XLA outputs, then the last block tells every peer "I consumed epoch n".
//   combine send    the rows of all local experts as one list over a one-wave grid: every valid row back to its
//                   source rank, slot [global e][token]; the last block raises every c_flags[e] of every rank.
//   combine recv    blocks (t, part): wait for the flags of t's experts, y[t] = sum_k w[t, k] * row(e_k, t) in f32.
//
// Every kernel: open (read the chain state / token, decide) -> body (only when the op works) -> finish (the last block
// writes the output state): low_latency_protocol.cuh, low_latency_params.h. A skipped op waits for nothing and writes to no peer.
// Epochs, halves and single-writer flags: see cuda/include/jax_ep/staging_layout.h. Memory ordering as in
// transport/peer.cuh: peer stores -> __syncthreads (and the last-block tickets) -> st.release.sys of the flag; the
// reader spins with ld.acquire.sys, then __syncthreads, then reads peer-written data with ld.cg (L1 is not coherent
// with peer stores).
// NOTE: the receive kernels spin inside their (at most ~2 x SMs) blocks instead of in a separate one-warp kernel:
// for latency, one kernel launch less. They only wait for kernels that were queued before them on every GPU, and
// their grids are at most one wave (one_wave_blocks, combine_recv_grid), so no block waits for one that cannot be
// scheduled. A full wave may hold most of an SM's registers; other streams' kernels then wait for it to end.
// The fused kernels (send and receive places in one grid, which may exceed a wave) rely instead on the order of
// their role tickets: every send place belongs to a block that has started, and send blocks wait for no receive
// (low_latency_protocol.cuh, fused_frame). Their receive blocks are resident when the flags land only where the
// grid fits a wave (small T).
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
#include "jax_ep/layout_params.h"
#include "kernels/low_latency_device.cuh"
#include "kernels/low_latency_protocol.cuh"
#include "kernels/low_latency_per_rank_kernels.h"
#include "kernels/low_latency_recv.cuh"
#include "kernels/low_latency_send.cuh"
#include "transport/peer.cuh"

namespace jax_ep::low_latency {
namespace {

// ---------------------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_dispatch_recv_kernel(const __grid_constant__ DispatchRecvParams p) {
  receive_frame(p, [&](uint32_t epoch) { dispatch_recv_body(p, epoch, PeerWait{}, BlockPlace::of_grid()); });
}

// ---------------------------------------------------------------------------------------------------------------
static_assert(kMaxLowLatencyExperts <= 2 * kThreads, "block_exclusive_scan of one count per local expert");

// The rows of every local expert as one list (expert, then row): warp items (row, segment) over the whole grid, so
// an expert with more rows than the others does not hold the kernel back. Every block derives the list from the
// handle's layout_range: s_off[l][s] = rows of expert l from sources before s, s_first[l] = rows of experts before l.
__device__ __forceinline__ void combine_send_body(const CombineSendParams& p, uint32_t epoch, const BlockPlace& b) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, H = c.hidden, Tm = c.max_tokens;
  const int rows_per_expert = R * Tm, row_bytes = 2 * H, tid = threadIdx.x;
  const int64_t half = half_offset(c.low_latency, epoch);
  __shared__ int32_t s_off[kMaxLowLatencyExperts];    // [l][s] (E = L * R <= kMaxLowLatencyExperts)
  __shared__ int32_t s_first[kMaxLowLatencyExperts];  // [l]
  __shared__ int32_t s_warp[32];
  if (tid < R) wait_consumed(g, tid, epoch);
  phase_stamp(g_ll_phases, kPhaseSendConsumed);
  for (int idx = tid; idx < L * R; idx += blockDim.x)  // a corrupted handle never indexes out of bounds
    s_off[idx] = min(max(__ldg(p.layout_range + idx), 0), Tm);
  __syncthreads();
  for (int l = tid; l < L; l += blockDim.x) {
    int32_t run = 0;
    for (int s = 0; s < R; ++s) {
      const int32_t n = s_off[l * R + s];
      s_off[l * R + s] = run;
      run += n;
    }
    s_first[l] = run;
  }
  const int total = block_exclusive_scan(s_first, L, s_warp);
  const int nseg = (row_bytes + kSegBytes - 1) / kSegBytes;
  const char* expert_out = static_cast<const char*>(p.expert_out);
  for (int item = b.global_warp(); item < total * nseg; item += b.num_global_warps()) {
    const int row = item / nseg, seg = item % nseg, off = seg * kSegBytes;
    int l = 0, hi = L - 1;  // the last expert whose rows start at or before `row` (the one holding it)
    while (l < hi) {
      const int mid = (l + hi + 1) / 2;
      if (s_first[mid] <= row) l = mid; else hi = mid - 1;
    }
    const int i = row - s_first[l];
    const int s = source_of_row(s_off + l * R, R, i);  // reads s_off[l][1..R-1] only
    const int32_t t = __ldg(p.src_info + static_cast<int64_t>(l) * rows_per_expert + i);
    if (t < 0 || t >= Tm) continue;  // a corrupted handle never writes out of bounds
    char* dst = peer_base(g, s) + half + c.low_latency.rows +
                (static_cast<int64_t>(me * L + l) * Tm + t) * row_bytes + off;
    copy_segment_nc(dst, expert_out + (static_cast<int64_t>(l) * rows_per_expert + i) * row_bytes + off,
                    min(kSegBytes, row_bytes - off));
  }
}

// The last block of a working combine send: c_flags[me * L + l] of every local expert l at every rank.
__device__ __forceinline__ void publish_combine_flags(const CombineSendParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local;
  const int64_t half = half_offset(c.low_latency, epoch);
  for (int idx = threadIdx.x; idx < R * L; idx += blockDim.x) {
    const int d = idx / L, l = idx % L;
    st_release_sys(header_word(peer_base(g, d) + half, c.low_latency.c_flags + 4 * (me * L + l)), epoch);
  }
}

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_combine_send_kernel(const __grid_constant__ CombineSendParams p) {
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  phase_begin(g_ll_phases);
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, 0, p.fused ? "low-latency combine" : "low-latency combine send", &s_gate);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendOpened);
  if (s_gate.work) combine_send_body(p, s_gate.epoch, BlockPlace::of_grid());  // block-uniform
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendBody);
  if (!last_block<TicketScope::kGpu>(low_latency_word(p.c.g, SignalHeader::kLowLatencySendDone), &s_last)) return;
  phase_stamp(g_ll_phases, kPhaseSendLast);
  if (s_gate.work) publish_combine_flags(p, s_gate.epoch);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseSendPublished);
  if (threadIdx.x == 0) finish_send_last(p.c.g, p.io, s_gate);
}

// ---------------------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kCombineRecvThreads) low_latency_combine_recv_kernel(const __grid_constant__ CombineRecvParams p) {
  receive_frame(p, [&](uint32_t epoch) { combine_recv_body(p, epoch, PeerWait{}, BlockPlace::of_grid()); });
}

// ---------------------------------------------------------------------------------------------------------------
// The fused ops of per_expert mode: send and receive in one kernel (low_latency_protocol.cuh, fused_frame), so the
// receive's blocks are resident, opened and waiting when the flags land, with no launch between the halves.

// Calls of at most this many tokens run the fused dispatch kernel, larger ones its two kernels. The fused kernel's
// blocks are capped at 64 registers (two per SM, so receive blocks sit beside send blocks), where the send body
// spills; one launch less pays for that only while the call's fixed costs dominate (the measurements:
// docs/BENCHMARKS.md, "Where the time goes (low latency)"). The fused combine kernel has no such cost.
constexpr int kFusedDispatchMaxTokens = 1;

struct DispatchFusedParams {
  DispatchSendParams send;
  DispatchRecvParams recv;  // its io is unused: the send's state and the op's decision serve both
  int32_t senders;          // send places (send_grid); then L x parts receive places (expert_grid)
};

static_assert(kSendThreads == kThreads, "a fused dispatch kernel's blocks play both halves");

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_dispatch_fused_kernel(const __grid_constant__ DispatchFusedParams p) {
  extern __shared__ __align__(16) char s_row[];  // fp8: one quantized message payload (send places)
  const int L = p.recv.c.num_local;
  fused_frame(
      p.send.c.g, p.send.io, "low-latency dispatch", p.senders,
      [&](uint32_t epoch, int place) {
        dispatch_send_body<false>(p.send, epoch, s_row, BlockPlace{place, 0, p.senders, 1});
      },
      [&](uint32_t epoch) { publish_counts<false>(p.send, epoch); },
      [&](uint32_t epoch, int place, int places) {
        dispatch_recv_body(p.recv, epoch, PeerWait{}, BlockPlace{place % L, place / L, L, places / L});
      });
}

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_combine_fused_kernel(const __grid_constant__ CombineFusedParams p) {
  const int bx = p.recv_tokens;
  fused_frame(
      p.send.c.g, p.send.io, "low-latency combine", p.senders,
      [&](uint32_t epoch, int place) { combine_send_body(p.send, epoch, BlockPlace{place, 0, p.senders, 1}); },
      [&](uint32_t epoch) { publish_combine_flags(p.send, epoch); },
      [&](uint32_t epoch, int place, int places) {
        combine_recv_body(p.recv, epoch, PeerWait{}, BlockPlace{place % bx, place / bx, bx, places / bx});
      });
}

}  // namespace

Status preload_kernels() {
  JAX_EP_RETURN_IF_ERROR(per_rank::preload_kernels());
  JAX_EP_RETURN_IF_ERROR(ll_phase_devices().arm(g_ll_phases));
  return preload({reinterpret_cast<const void*>(low_latency_dispatch_send_kernel<false>),
                  reinterpret_cast<const void*>(low_latency_dispatch_send_kernel<true>),
                  reinterpret_cast<const void*>(low_latency_dispatch_recv_kernel),
                  reinterpret_cast<const void*>(low_latency_combine_send_kernel),
                  reinterpret_cast<const void*>(low_latency_combine_recv_kernel),
                  reinterpret_cast<const void*>(low_latency_dispatch_fused_kernel),
                  reinterpret_cast<const void*>(low_latency_combine_fused_kernel)});
}

Status phases(bool reset, std::vector<std::string>* names, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits) {
  ns->clear();
  hits->clear();
  JAX_EP_RETURN_IF_ERROR(ll_phase_devices().read(g_ll_phases, reset, ns, hits));
  JAX_EP_RETURN_IF_ERROR(per_rank::add_phases(reset, ns, hits));
  names->assign(low_latency_phase_names(), low_latency_phase_names() + kLowLatencyNvlinkPhases);
  ns->resize(kLowLatencyNvlinkPhases);
  hits->resize(kLowLatencyNvlinkPhases);
  return Status::Ok();
}

Status launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  const int grid = send_grid(p);
  const int smem = send_shared_bytes(p.use_fp8, p.c.hidden);
  static const int static_smem[2] = {  // a property of the kernel, not of the GPU: asked once
      static_shared_bytes(reinterpret_cast<const void*>(low_latency_dispatch_send_kernel<false>)),
      static_shared_bytes(reinterpret_cast<const void*>(low_latency_dispatch_send_kernel<true>))};
  JAX_EP_RETURN_IF_ERROR(check_send_shared(std::max(0, static_smem[p.per_rank ? 1 : 0]), smem, p.c.hidden));
  if (p.per_rank)
    low_latency_dispatch_send_kernel<true><<<grid, kSendThreads, smem, stream>>>(p);
  else
    low_latency_dispatch_send_kernel<false><<<grid, kSendThreads, smem, stream>>>(p);
  return launched(p.per_rank ? "low-latency dispatch send (per_rank)" : "low-latency dispatch send");
}

Status launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream) {
  if (p.per_rank) return per_rank::launch_dispatch_recv(p, stream);
  low_latency_dispatch_recv_kernel<<<expert_grid(p.c), kThreads, 0, stream>>>(p);
  return launched("low-latency dispatch receive");
}

Status launch_dispatch(const DispatchSendParams& send, const DispatchRecvParams& recv, cudaStream_t stream) {
  const int smem = send_shared_bytes(send.use_fp8, send.c.hidden);
  static const int static_smem =  // a property of the kernel, not of the GPU: asked once
      static_shared_bytes(reinterpret_cast<const void*>(low_latency_dispatch_fused_kernel));
  // Two kernels: per_rank mode; calls of more than kFusedDispatchMaxTokens tokens; an fp8 row too wide for the fused
  // kernel's shared memory beside its receive's.
  if (send.per_rank || send.num_tokens > kFusedDispatchMaxTokens || static_smem < 0 ||
      static_smem + smem > kMaxSendSharedBytes) {
    JAX_EP_RETURN_IF_ERROR(launch_dispatch_send(send, stream));
    return launch_dispatch_recv(recv, stream);
  }
  const DispatchFusedParams p{send, recv, send_grid(send)};
  // receive parts: an expert gets at most R x T rows; about 16 rows a block (a row per warp)
  const int64_t rows = static_cast<int64_t>(send.c.g.num_ranks) * std::max(send.num_tokens, 1);
  const dim3 receive = expert_grid(recv.c, static_cast<int>(std::min<int64_t>(16, (rows + 15) / 16)));
  low_latency_dispatch_fused_kernel<<<p.senders + static_cast<int>(receive.x * receive.y), kThreads, smem, stream>>>(p);
  return launched("low-latency dispatch");
}

Status launch_combine_send(const CombineSendParams& p, cudaStream_t stream) {
  if (p.per_rank) return per_rank::launch_combine_send(p, stream);
  low_latency_combine_send_kernel<<<combine_send_blocks(p), kThreads, 0, stream>>>(p);
  return launched("low-latency combine send");
}

Status launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  if (p.per_rank) return per_rank::launch_combine_recv(p, stream);
  const dim3 grid = combine_recv_grid(p, kCombineRecvThreads);
  low_latency_combine_recv_kernel<<<grid, kCombineRecvThreads, 0, stream>>>(p);
  return launched("low-latency combine receive");
}

Status launch_combine(const CombineSendParams& send, const CombineRecvParams& recv, cudaStream_t stream) {
  if (send.per_rank) return per_rank::launch_combine(send, recv, stream);
  const dim3 receive = combine_recv_grid(recv, kThreads);
  const CombineFusedParams p{send, recv, combine_send_blocks(send), static_cast<int32_t>(receive.x)};
  low_latency_combine_fused_kernel<<<p.senders + static_cast<int>(receive.x * receive.y), kThreads, 0, stream>>>(p);
  return launched("low-latency combine");
}

}  // namespace jax_ep::low_latency
