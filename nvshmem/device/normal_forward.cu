// The hierarchical forwarders of normal mode over NVSHMEM (GroupCtx::forward_nvl = num_max_nvl_peers > 1, nodes of
// 2-8 ranks): a token crosses to each destination node once, to the rank of the sender's local index there (the
// forwarder), which fans it out over NVLink (dispatch) or sums its node's rows into one partial per (token, node)
// and puts that back (node-first combine). Slots and records: staging_layout.h (fwd_*); record tags are cleared at
// every barrier (normal_send.cu), so a non-zero tag was put this op.
#include "common/preload.cuh"
#include "device/normal_common.cuh"
#include "device/remote_puts.cuh"

namespace jax_ep::nvshmem {
namespace {

// Hierarchical dispatch, after the sources of this rank's local index have announced (wait kernel, kWaitForwarders):
// every forwarded token of slot [node][t] (tag set) goes to the destination rows of this node its record names,
// over NVLink: the row into payload, the destination's meta record (its local ids and weights, source index,
// scales) into remote_meta, as the flat kernels' puts would have. The last block then flags this node's ranks.
// One warp per (source node, token); the direct rows of this rank's own send kernel are in place (stream order).
// NOTE: the slots walked are [0, a.num_tokens) of each source node: every shard of a shard_map call has the same T
// (static shapes), so a source's tokens are this rank's count. The forwarding area is read through the
// non-coherent path (fan_out_row's ld_nc_v4): valid because every put of the op has landed before this kernel
// starts (the kWaitForwarders kernel before it); forwarding while the RDMA leg is in flight would need ld_cg.
__global__ void __launch_bounds__(kSendThreads) nvshmem_forward_kernel(const __grid_constant__ SendArgs a) {
  const GroupCtx& g = a.g;
  const BufferLayout& B = g.layout;
  const int nvl = g.forward_nvl, R = g.num_ranks, nodes = R / nvl, my_node = g.rank / nvl, lane = lane_id();
  const int K = a.num_weights;
  const int64_t Km = B.meta_k;
  const bool has_ids = a.topk_idx != nullptr;
  const bool full_record = has_ids || a.write_src_idx || a.scale_cols > 0;
  const uint32_t epoch = current_epoch(g);
  const char* self = self_base(g);
  const int64_t total = static_cast<int64_t>(nodes - 1) * a.num_tokens;  // nodes >= 2 in a forwarding group
  for (int64_t item = global_warp(); item < total; item += num_global_warps()) {
    int n, t;
    other_node_item(item, nodes, my_node, &n, &t);
    const int64_t slot = forward_slot(B, n, my_node, t);
    const char* rec = self + B.fwd_meta + slot * B.fwd_stride;
    if (__ldcg(reinterpret_cast<const uint32_t*>(rec)) == 0u) continue;  // no destination in this node
    int32_t rows[kMaxNvlPeers];
    const int32_t my_row = lane < nvl ? __ldcg(reinterpret_cast<const int32_t*>(rec + 4) + lane) : -1;
#pragma unroll
    for (int j = 0; j < kMaxNvlPeers; ++j) rows[j] = __shfl_sync(0xffffffffu, my_row, j);
    fan_out_row<kMaxNvlPeers>(reinterpret_cast<const int4*>(self + B.fwd_rows + slot * a.row_bytes), a.row_bytes / 16,
                              rows, [&](int j) {
                                return reinterpret_cast<int4*>(peer_base(g, my_node * nvl + j) + B.payload +
                                                               static_cast<int64_t>(rows[j]) * a.row_bytes);
                              });
    const int32_t* ids = reinterpret_cast<const int32_t*>(rec + 4 * (1 + kMaxNvlPeers));
    const float* ws = reinterpret_cast<const float*>(rec + 4 * (1 + kMaxNvlPeers + Km));
    const float* scales = reinterpret_cast<const float*>(rec + 4 * (1 + kMaxNvlPeers + 2 * Km));
#pragma unroll
    for (int j = 0; j < kMaxNvlPeers; ++j) {
      if (rows[j] < 0) continue;
      const int d = my_node * nvl + j;
      char* out = peer_base(g, d) + B.remote_meta + static_cast<int64_t>(rows[j]) * B.meta_stride;
      if (lane < K) {
        int32_t id;
        float w;
        local_entry_of(has_ids ? __ldcg(ids + lane) : -1, __ldcg(ws + lane), has_ids, d, a.experts_per_rank, R, &id,
                       &w);
        reinterpret_cast<float*>(out)[lane] = w;
        if (full_record) reinterpret_cast<int32_t*>(out + 4 * Km)[lane] = id;
      }
      if (full_record && lane == 0) *reinterpret_cast<int32_t*>(out + 8 * Km) = t;
      float* out_scales = reinterpret_cast<float*>(out + 4 * (2 * Km + 1));
      for (int c = lane; c < a.scale_cols; c += 32) out_scales[c] = __ldcg(scales + c);
    }
  }
  finish_and_announce(g, epoch, kAnnounceNode);
}

// Node-first combine, on the forwarder, after its node's ranks have flagged their rows (kWaitNode): for every
// (source node n, token t) with a contributor mask (the record tag word of slot [n][t], OR-ed in by the node's ranks;
// cleared at the barrier), the f32 sum of the contributed rows in local-index order cast to the values' dtype, and the
// f32 sum of their weights, staged at combine_partial_row and put into the fwd_rows / fwd_meta slot [this node][t]
// of the source (n, this local index). Contributor i's row is read where i staged it (its send_rows / send_weights
// at the row index in the record) over NVLink; i does not reuse its send area before this op's end (every op begins
// with a rendezvous). One warp per (n, t); the last block announces to the sources of this local index.
constexpr int kForwardUnroll = 4;  // 16-byte vectors per lane in flight in the forwarder's sums
template <typename Elem>
__global__ void __launch_bounds__(kSendThreads) nvshmem_combine_forward_kernel(const __grid_constant__ CombineParams p) {
  using Pk = Pack<Elem>;
  const GroupCtx& g = p.g;
  const BufferLayout& B = g.layout;
  const int nvl = g.forward_nvl, nodes = g.num_ranks / nvl, my_node = g.rank / nvl, lane = lane_id();
  const int Kw = p.num_weights, n16 = p.row_bytes / 16;
  const uint32_t epoch = current_epoch(g);
  char* self = self_base(g);
  bool put_any = false;
  const int64_t total = static_cast<int64_t>(nodes - 1) * p.num_tokens;  // nodes >= 2 in a forwarding group
  for (int64_t item = global_warp(); item < total; item += num_global_warps()) {
    int n, t;
    other_node_item(item, nodes, my_node, &n, &t);
    const int64_t fslot = forward_slot(B, n, my_node, t);
    const char* rec = self + B.fwd_meta + fslot * B.fwd_stride;
    const uint32_t mask = __ldcg(reinterpret_cast<const uint32_t*>(rec));
    if (mask == 0u) continue;  // no rank of this node kept token t of source (n, my local index)
    // contributor i's staged row (lane i holds i's row index; the mask says which lanes are valid)
    const int32_t my_row =
        lane < nvl ? __ldcg(reinterpret_cast<const int32_t*>(rec + combine_record_rows_offset(B.meta_k)) + lane) : 0;
    // the partial is staged and sent in the values' dtype (bf16: 2H bytes per (token, node) over RDMA, like the
    // rows it replaces; the f32 sum is rounded once here and once more at the source, SPEC's tolerance)
    // kForwardUnroll vectors per lane in flight per contributor (one at a time left the warp waiting on each load:
    // the kernel was latency-bound); each element's sum keeps the local-index order.
    const int64_t part_row = combine_partial_row(B, nvl, fslot);
    int4* part = reinterpret_cast<int4*>(self + B.payload + part_row * p.row_bytes);
    for (int first = 0; first < n16; first += 32 * kForwardUnroll) {  // warp-uniform trips: the shuffles below
      const int base = first + lane;
      float acc[kForwardUnroll][Pk::kN];
#pragma unroll
      for (int u = 0; u < kForwardUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < Pk::kN; ++e) acc[u][e] = 0.0f;
      }
      for (uint32_t m = mask; m != 0u; m &= m - 1u) {
        const int i = __ffs(m) - 1;
        const int64_t row = __shfl_sync(0xffffffffu, my_row, i);
        const int4* src =
            reinterpret_cast<const int4*>(peer_base(g, my_node * nvl + i) + B.send_rows + row * p.row_bytes);
        int4 v[kForwardUnroll];
#pragma unroll
        for (int u = 0; u < kForwardUnroll; ++u)
          if (base + 32 * u < n16) v[u] = ld_cg_v4(src + base + 32 * u);
#pragma unroll
        for (int u = 0; u < kForwardUnroll; ++u)
          if (base + 32 * u < n16) Pk::add(acc[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kForwardUnroll; ++u)
        if (base + 32 * u < n16) part[base + 32 * u] = Pk::pack(acc[u]);
    }
    float* s_w = reinterpret_cast<float*>(self + B.topk_weights) + part_row * Kw;
    float wacc = 0.0f;
    for (uint32_t m = mask; m != 0u; m &= m - 1u) {
      const int i = __ffs(m) - 1;
      const int64_t row = __shfl_sync(0xffffffffu, my_row, i);  // every lane: the shuffle is warp-wide
      if (lane < Kw)
        wacc += __ldcg(reinterpret_cast<const float*>(peer_base(g, my_node * nvl + i) + B.send_weights) + row * Kw +
                       lane);
    }
    if (lane < Kw) s_w[lane] = wacc;
    __threadfence();  // the staged partials are in memory before the puts read them
    __syncwarp();
    const int pe = pe_of(g, n * nvl + g.rank % nvl);
    const int64_t dslot = forward_slot(B, my_node, n, t);  // at the source, of node n
    put_plain(self + B.fwd_rows + dslot * B.payload_stride, reinterpret_cast<const char*>(part), p.row_bytes, pe);
    if (Kw > 0) put_plain(self + B.fwd_meta + dslot * B.fwd_stride + 4, reinterpret_cast<const char*>(s_w), 4 * Kw, pe);
    put_any = true;
  }
  if (put_any) nvshmem_quiet();
  finish_and_announce(g, epoch, kAnnounceForwarders);
}

}  // namespace

const char* launch_dispatch_forward(const SendArgs& a, int blocks, cudaStream_t stream) {
  nvshmem_forward_kernel<<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(a);
  return launch_error("dispatch forward (NVLink)");
}

const char* launch_combine_forward(const CombineParams& p, int blocks, cudaStream_t stream) {
  if (p.dtype == CombineDtype::kBF16)
    nvshmem_combine_forward_kernel<__nv_bfloat16><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(p);
  else
    nvshmem_combine_forward_kernel<float><<<clamp_blocks(blocks), kSendThreads, 0, stream>>>(p);
  return launch_error("combine forward (NVSHMEM)");
}

Status preload_forward_kernels() {
  return preload({reinterpret_cast<const void*>(nvshmem_forward_kernel),
                  reinterpret_cast<const void*>(nvshmem_combine_forward_kernel<__nv_bfloat16>),
                  reinterpret_cast<const void*>(nvshmem_combine_forward_kernel<float>)});
}

}  // namespace jax_ep::nvshmem
