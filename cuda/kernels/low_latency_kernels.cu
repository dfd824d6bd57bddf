// Low-latency mode (SPEC §4): dispatch into per-expert slots and weighted combine, each as a send kernel and a
// receive kernel (the two halves of the split custom calls; the fused op runs both back to back).
//
//   dispatch send   low_latency_send.cuh (one template for both modes): one block per token, its row read (fp8: quantized)
//                   once and written once per distinct expert into the owner at slot [l][me][position]; the last
//                   block publishes every expert's count and (l, me) flag. No count exchange, no barrier: positions
//                   are known locally, so the send never waits for a peer (except the rare "peer still reads op
//                   n-2" check).
//   dispatch recv   blocks (l, part): wait for the R flags of expert l, pack rows in (source, token) order into the
//                   XLA outputs, then the last block tells every peer "I consumed epoch n".
//   combine send    blocks (l, part): every valid row of expert l back to its source rank, slot [global e][token];
//                   the last block of expert l raises the c_flags[e] of every rank.
//   combine recv    blocks (t, part): wait for the flags of t's experts, y[t] = sum_k w[t, k] * row(e_k, t) in f32.
//
// Every kernel: open (read the chain state / token, decide) -> body (only when the op works) -> finish (the last block
// writes the output state): low_latency_protocol.cuh, low_latency_params.h. A skipped op waits for nothing and writes to no peer.
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
  receive_frame(p, [&](uint32_t epoch) { dispatch_recv_body(p, epoch, PeerWait{}); });
}

// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void combine_send_body(const CombineSendParams& p, uint32_t epoch) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, H = c.hidden, Tm = c.max_tokens;
  const int rows_per_expert = R * Tm, row_bytes = 2 * H;
  const int l = blockIdx.x, part = blockIdx.y, parts = gridDim.y, tid = threadIdx.x;
  const int64_t half = half_offset(c.low_latency, epoch);
  __shared__ int32_t s_off[kMaxGroupRanks + 1];
  if (tid == 0) source_offsets(s_off, p.layout_range + l * R, R, Tm);
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
    char* dst = peer_base(g, s) + half + c.low_latency.rows +
                (static_cast<int64_t>(me * L + l) * Tm + t) * row_bytes + off;
    copy_segment_nc(dst, rows + static_cast<int64_t>(i) * row_bytes + off, min(kSegBytes, row_bytes - off));
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence_system();  // this block's peer stores happen before it is counted
    uint32_t* blocks_done = reinterpret_cast<uint32_t*>(self_base(g) + c.low_latency.scratch) + l;
    if (atomicAdd(blocks_done, 1u) == static_cast<uint32_t>(parts - 1)) {
      atomicExch(blocks_done, 0u);
      __threadfence_system();
      for (int d = 0; d < R; ++d)
        st_release_sys(header_word(peer_base(g, d) + half, c.low_latency.c_flags + 4 * (me * L + l)), epoch);
    }
  }
}

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    low_latency_combine_send_kernel(const __grid_constant__ CombineSendParams p) {
  __shared__ Gate s_gate;
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, 0, p.fused ? "low-latency combine" : "low-latency combine send", &s_gate);
  __syncthreads();
  if (s_gate.work) combine_send_body(p, s_gate.epoch);  // block-uniform
  finish_send(p.c.g, p.io, s_gate);
}

// ---------------------------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kCombineRecvThreads) low_latency_combine_recv_kernel(const __grid_constant__ CombineRecvParams p) {
  receive_frame(p, [&](uint32_t epoch) { combine_recv_body(p, epoch, PeerWait{}); });
}

}  // namespace

Status preload_kernels() {
  JAX_EP_RETURN_IF_ERROR(per_rank::preload_kernels());
  return preload({reinterpret_cast<const void*>(low_latency_dispatch_send_kernel<false>),
                  reinterpret_cast<const void*>(low_latency_dispatch_send_kernel<true>),
                  reinterpret_cast<const void*>(low_latency_dispatch_recv_kernel),
                  reinterpret_cast<const void*>(low_latency_combine_send_kernel),
                  reinterpret_cast<const void*>(low_latency_combine_recv_kernel)});
}

Status launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  const int grid = send_grid(p);
  const int smem = send_shared_bytes(p.use_fp8, p.c.hidden);
  JAX_EP_RETURN_IF_ERROR(check_send_shared(smem, p.c.hidden));
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
  JAX_EP_RETURN_IF_ERROR(launch_dispatch_send(send, stream));
  return launch_dispatch_recv(recv, stream);
}

Status launch_combine_send(const CombineSendParams& p, cudaStream_t stream) {
  if (p.per_rank) return per_rank::launch_combine_send(p, stream);
  low_latency_combine_send_kernel<<<expert_grid(p.c), kThreads, 0, stream>>>(p);
  return launched("low-latency combine send");
}

Status launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  if (p.per_rank) return per_rank::launch_combine_recv(p, stream);
  low_latency_combine_recv_kernel<<<combine_recv_grid(p), kCombineRecvThreads, 0, stream>>>(p);
  return launched("low-latency combine receive");
}

Status launch_combine(const CombineSendParams& send, const CombineRecvParams& recv, cudaStream_t stream) {
  JAX_EP_RETURN_IF_ERROR(launch_combine_send(send, stream));
  return launch_combine_recv(recv, stream);
}

}  // namespace jax_ep::low_latency
