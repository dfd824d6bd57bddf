// The staging buffer of one rank: its layout in both modes and the plan that sizes it. The one owner of these
// formulas (Python asks the native module: normal_buffer_bytes, low_latency_buffer_bytes, staging_plan).
//
//   buffer = [signal header | normal region ... | low-latency region]
//             0               kSignalHeaderBytes  low_latency_offset            low_latency_offset + low_latency_bytes
//
// The runtime allocates one buffer per device sized by staging_plan() over every config it serves: the normal region
// is as large as the largest normal layout, the low-latency region (when any config has LL buffers) starts at
// low_latency_offset = the aligned end of the normal region and is as large as the largest LL region. bind_axis() tells the
// handlers (low_latency_offset, low_latency_bytes), so every LL config of a program addresses the same region.
#pragma once

#include <cstddef>
#include <cstdint>

#include "jax_ep/constants.h"
#include "jax_ep/macros.h"

namespace jax_ep {

JAX_EP_HD int64_t align_up(int64_t n, int64_t a = kAlign) { return (n + a - 1) / a * a; }

// ---- normal mode ----------------------------------------------------------------------------------------------
//   [signals | payload | scales | topk_idx | topk_weights | src_idx], each region aligned to kAlign bytes.
//   signals = the fixed header, then counts i32[R][R], expert counts i32[R][L], scratch, the receive targets, the
//   count words and the notify scratch.
//   rows = max(capacity, combine_slot_rows): dispatch receives up to `capacity` rows; combine's slots
//   (combine_slot_rows) take the rows its peers push. Dispatch and combine never use the region at the same time:
//   every op begins with a rendezvous (a barrier, or dispatch's count exchange; docs/ARCHITECTURE.md "Normal-mode
//   kernels").
struct BufferLayout {
  int64_t rows;            // staging rows: max(capacity, combine_slot_rows)
  int64_t counts;          // i32 [R][R] counts[src][dst], written by src into every rank (NVSHMEM kernels; the
                           // NVLink kernels add the counts up from count_words in the notify kernel's shared memory)
  int64_t expert_counts;   // i32 [R][L] expert_counts[src][l], written by src (NVSHMEM kernels)
  int64_t recv_targets;    // kRecvTargetBytes [R]: dispatch's receive targets of rank s (RecvTargets), written by s
                           // (NVSHMEM kernels) or by this rank from count_words (NVLink kernels)
  // NVLink kernels: u64 [R][count_words_per_rank(R, L)] epoch words (epoch << 32 | value) rank s sends this rank in
  // its dispatch notify, one per value: s's row of counts [R], its expert counts of this rank's L experts, the 16
  // u32 of its RecvTargets as this rank addresses them. Each word carries its own epoch: no signal orders them.
  int64_t count_words;
  // This rank's dispatch notify blocks (NVLink kernels; never peer-written): i32 [kMaxNotifyBlocks][R] tokens of
  // each block's chunk sent to each rank, turned by the last block into each chunk's first position per rank (read
  // by the send kernel, which completes send_pos), then i32 [kMaxNotifyBlocks][E] each chunk's per-expert counts.
  // Every entry is written before it is read in the same op: nothing is assumed of it between ops (configs of
  // other R or E share the buffer at other offsets).
  int64_t notify_scratch;
  int64_t payload;         // rows x payload_stride bytes
  int64_t payload_stride;  // bytes per row (4 * hidden: the f32 worst case)
  int64_t scales;          // f32 [rows][ceil(H/128)]
  int64_t topk_idx;        // i32 [rows][K]
  int64_t topk_weights;    // f32 [rows][K]
  int64_t src_idx;         // i32 [rows]
  // Normal mode over NVSHMEM only (0 otherwise). A dispatched row from a remote rank arrives as two puts: the row
  // into `payload` (as the NVLink stores), and one meta record into `remote_meta` at the same row index:
  //   record = [weights f32 K | local ids i32 K | source index i32 | scales f32 ceil(H/128)], meta_stride bytes
  // (cached dispatch fills the weights only). The copy-out reads the record for rows of remote sources.
  int64_t meta_k;          // K of the record layout (num_topk)
  int64_t meta_stride;     // bytes per record: align16(4 * (2K + 1 + ceil(H/128)))
  int64_t remote_meta;     // records [capacity]
  // The sources of this rank's puts, which must be symmetric memory; dispatch: by token and destination, combine:
  // by received row.
  int64_t send_rows;       // max(capacity, T_max) x payload_stride bytes
  int64_t send_meta;       // records [T_max][R] (ids and weights are per destination)
  int64_t send_weights;    // f32 [as send_rows][K]: the combine's weights
  int64_t expert_out;      // i32 [E]: this rank's per-expert counts (the count exchange's puts read slices)
  // Hierarchical dispatch (forward_nodes() > 0: nodes of nvl_domain >= 2 ranks; 0 otherwise). A token crosses to
  // another node once, to the rank of that node with this rank's local index (the forwarder), which stores it over
  // NVLink into each of its node's destination ranks (nvshmem/device/normal_send.cu):
  //   record = [tag u32 | destination rows i32 kMaxNvlPeers | global ids i32 K | weights f32 K |
  //             scales f32 ceil(H/128)], fwd_stride bytes; tag != 0: written this op (cleared at every barrier)
  // Node-first combine reuses them. A rank is the forwarder of the sources of its local index on the other nodes and
  // the source of its own tokens; record [node][t] serves both roles in disjoint words:
  //   combine record = [contributor mask u32 (forwarder: this node's ranks holding token t of source (node, my
  //                     local index), OR-ed in) | partial weights f32 K (source: the sum node `node` put back for my
  //                     token t) | contributor rows i32 kMaxNvlPeers (forwarder: local rank i's received row of that
  //                     token, whose values i staged in its own send_rows / send_weights)]
  // fwd_rows slot [node][t] (stride payload_stride) takes node's partial row of token t at the source. A forwarder
  // stages its partials in its own payload / topk_weights at combine_partial_row (past the direct slots), so no
  // area holds a slot per (rank, token) of the group: the forwarder reads the contributions where they were staged,
  // at offsets from its own layout (every rank of a group runs the same config, so the layouts are equal).
  int64_t fwd_nodes;       // nodes of the group (R / nvl_domain)
  int64_t fwd_slots;       // T_max: slots per other node (forward_slot)
  int64_t fwd_stride;      // bytes per forward record
  int64_t fwd_rows;        // rows [nodes - 1][T_max] x payload_stride: received for forwarding, by source node
  int64_t fwd_meta;        // records [nodes - 1][T_max], by source node
  int64_t send_fwd_meta;   // records [T_max][nodes - 1], by destination node (the sources of the puts)
  int64_t total;           // bytes
};

// Nodes of a normal-mode group over NVSHMEM that dispatches hierarchically (one copy per token and node, forwarded
// inside the node over NVLink), or 0 for the flat kernels (one copy per token and destination rank): nodes of at
// least 2 and at most kMaxNvlPeers ranks, at least 2 of them, R a multiple of the node size.
JAX_EP_HD int64_t forward_nodes(int64_t num_ranks, int64_t nvl_domain) {
  if (nvl_domain < 2 || nvl_domain > kMaxNvlPeers || num_ranks % nvl_domain != 0) return 0;
  return num_ranks / nvl_domain >= 2 ? num_ranks / nvl_domain : 0;
}

// Slot of (node, token t) in a forwarding area (fwd_rows, fwd_meta) of a rank of node `owner_node`: one row of
// fwd_slots per node other than the owner's, in node order (node != owner_node).
JAX_EP_HD int64_t forward_slot(const BufferLayout& b, int node, int owner_node, int t) {
  return static_cast<int64_t>(node - (node > owner_node ? 1 : 0)) * b.fwd_slots + t;
}

JAX_EP_HD int64_t forward_record_bytes(int64_t num_topk, int64_t scale_cols) {
  return 4 * (1 + kMaxNvlPeers + 2 * num_topk + scale_cols);
}

// Byte offset, inside a combine record, of the contributor rows (after the mask and the K partial weights; a record
// holds at least 4 * (1 + kMaxNvlPeers + 2K) bytes). A combine puts at most K weights per row (its handler checks
// the weights' columns against num_topk), so the partial weights never reach the rows.
JAX_EP_HD int64_t combine_record_rows_offset(int64_t num_topk) { return 4 * (1 + num_topk); }

// Combine's push slots in the payload (and topk_weights) region, in rows of T_max:
//   flat (fwd_nodes == 0): one per (pushing rank, token): [R][T_max];
//   forwarding groups: one per (rank of this node, token), then the forwarder's partials per (other node, token):
//   [nvl][T_max] direct slots, then [nodes - 1][T_max] at combine_partial_row. Remote ranks reach the source only
//   through the forwarders' partials, so the group size enters through the nodes, not the ranks.
JAX_EP_HD int64_t combine_slot_rows(int64_t num_ranks, int64_t max_tokens_per_rank, int64_t fwd_nodes) {
  if (fwd_nodes <= 0) return num_ranks * max_tokens_per_rank;
  return (num_ranks / fwd_nodes + fwd_nodes - 1) * max_tokens_per_rank;
}

// Row of a forwarder's staged partial for forward slot fslot (forward_slot: [other node][t]), past the direct slots.
JAX_EP_HD int64_t combine_partial_row(const BufferLayout& b, int64_t nvl, int64_t fslot) {
  return nvl * b.fwd_slots + fslot;
}

// Bytes of one rank's entry in recv_targets (normal_params.h: RecvTargets).
constexpr int64_t kRecvTargetBytes = 64;

// The regions peers write into (counts, expert_counts, receive targets, count words) end at the same offset for every
// E: the expert counts and count words get room for kMaxLayoutExperts. The configs of one axis share the staging, and
// a dispatch writes these regions with its count exchange as its only rendezvous, while a peer may still read the
// rows of its previous op (of any config): those rows must never lie under another config's peer-written window.
JAX_EP_HD int64_t recv_targets_offset(int64_t num_ranks) {
  return align_up(kSignalHeaderBytes + 4 * (num_ranks * num_ranks + kMaxLayoutExperts + 4 * num_ranks + 4), 16);
}

// The epoch words a rank sends each rank in a dispatch's count exchange (BufferLayout::count_words): its counts
// row [R], its expert counts of that rank's L experts, its RecvTargets as u32 words.
constexpr int64_t kRecvTargetWords = kRecvTargetBytes / 4;
JAX_EP_HD int64_t count_words_per_rank(int64_t num_ranks, int64_t num_local_experts) {
  return num_ranks + num_local_experts + kRecvTargetWords;
}

// After the receive targets, inside the peer-written window: room for R * count_words_per_rank(R, L) words for every
// E <= kMaxLayoutExperts (R * L = E).
JAX_EP_HD int64_t count_words_offset(int64_t num_ranks) {
  return recv_targets_offset(num_ranks) + kRecvTargetBytes * num_ranks;
}

JAX_EP_HD int64_t notify_scratch_offset(int64_t num_ranks, int64_t num_experts) {
  (void)num_experts;
  return count_words_offset(num_ranks) + 8 * (num_ranks * (num_ranks + kRecvTargetWords) + kMaxLayoutExperts);
}

JAX_EP_HD int64_t signal_bytes(int64_t num_ranks, int64_t num_experts) {
  return align_up(notify_scratch_offset(num_ranks, num_experts) + 4 * kMaxNotifyBlocks * (num_ranks + num_experts));
}

// nvshmem: the normal-mode ops of this config run over NVSHMEM (EPConfig.normal_over_nvshmem): add the send area;
// nvl_domain (num_max_nvl_peers, with nvshmem): the forwarding areas of hierarchical dispatch where forward_nodes > 0.
JAX_EP_HD BufferLayout make_buffer_layout(int64_t hidden, int64_t num_topk, int64_t max_tokens_per_rank,
                                          int64_t num_ranks, int64_t capacity, int64_t num_experts,
                                          bool nvshmem = false, int64_t nvl_domain = 0) {
  BufferLayout b{};
  const int64_t slot_rows =
      combine_slot_rows(num_ranks, max_tokens_per_rank, nvshmem ? forward_nodes(num_ranks, nvl_domain) : 0);
  b.rows = capacity > slot_rows ? capacity : slot_rows;
  const int64_t scale_cols = (hidden + kFp8Block - 1) / kFp8Block;
  b.counts = kSignalHeaderBytes;
  b.expert_counts = b.counts + 4 * num_ranks * num_ranks;
  b.recv_targets = recv_targets_offset(num_ranks);
  b.count_words = count_words_offset(num_ranks);
  b.notify_scratch = notify_scratch_offset(num_ranks, num_experts);
  b.payload_stride = 4 * hidden;
  b.payload = signal_bytes(num_ranks, num_experts);
  b.scales = b.payload + align_up(b.rows * b.payload_stride);
  b.topk_idx = b.scales + align_up(b.rows * 4 * scale_cols);
  b.topk_weights = b.topk_idx + align_up(b.rows * 4 * num_topk);
  b.src_idx = b.topk_weights + align_up(b.rows * 4 * num_topk);
  b.total = b.src_idx + align_up(b.rows * 4);
  if (nvshmem) {
    b.fwd_nodes = forward_nodes(num_ranks, nvl_domain);
    // The send area's rows (send_rows, send_weights) are indexed by token (dispatch: T_max) and by received row
    // (combine: capacity, the rows put to a flat source or read by a forwarder); remote_meta by received row.
    const int64_t send_count = capacity > max_tokens_per_rank ? capacity : max_tokens_per_rank;
    b.meta_k = num_topk;
    b.meta_stride = align_up(4 * (2 * num_topk + 1 + scale_cols), 16);
    b.remote_meta = b.total;
    b.send_rows = b.remote_meta + align_up(capacity * b.meta_stride);
    b.send_meta = b.send_rows + align_up(send_count * b.payload_stride);
    b.send_weights = b.send_meta + align_up(max_tokens_per_rank * num_ranks * b.meta_stride);
    b.expert_out = b.send_weights + align_up(send_count * 4 * num_topk);
    b.total = b.expert_out + align_up(num_experts * 4);
    if (b.fwd_nodes > 0) {
      const int64_t slots = (b.fwd_nodes - 1) * max_tokens_per_rank;  // forward_slot: the other nodes only
      b.fwd_slots = max_tokens_per_rank;
      b.fwd_stride = align_up(forward_record_bytes(num_topk, scale_cols), 16);
      b.fwd_rows = b.total;
      b.fwd_meta = b.fwd_rows + align_up(slots * b.payload_stride);
      b.send_fwd_meta = b.fwd_meta + align_up(slots * b.fwd_stride);
      b.total = b.send_fwd_meta + align_up(slots * b.fwd_stride);
    }
  }
  return b;
}

inline int64_t normal_buffer_bytes(int64_t hidden, int64_t num_topk, int64_t max_tokens_per_rank, int64_t num_ranks,
                                   int64_t capacity, int64_t num_experts, bool nvshmem = false,
                                   int64_t nvl_domain = 0) {
  return make_buffer_layout(hidden, num_topk, max_tokens_per_rank, num_ranks, capacity, num_experts, nvshmem,
                            nvl_domain).total;
}

// ---- low-latency mode -----------------------------------------------------------------------------------------
//   region = [scratch counters (kLowLatencyScratchBytes) | RDMA words (kLowLatencyNvshmemBytes) | half 0 |
//             half 1]
//
// LL ops (dispatch and combine alike) take consecutive epochs n = 1, 2, ... from one device counter; op n uses
// half n % 2. A rank writes into a peer's half only after that peer has finished reading the op two epochs back
// from the same half (the peer's "consumed" word of that half), so no op ever waits for a clean step and data of
// consecutive ops never collides. At most two LL ops (of all LL configs together) may be between their send and
// their receive at once: the state/token protocol (low_latency_params.h) refuses a third. One half:
//
//   c_flags  u32[E]          combine: epoch at which the owner of expert e finished writing its rows here
//   d_flags  u64[L][R]       dispatch (per_expert): source rank s's epoch word for local expert l (ptx.cuh
//                            epoch_word): the epoch at which s finished writing its rows of l, and how many rows, in
//                            one release store
//   d_counts i32[L][R]       dispatch (per_rank): rows of local expert l in source s's messages (valid once
//                            r_flags[s] says so)
//   rows                     dispatch: messages [L][R][T_max], msg_stride bytes each:
//                              [i32 source token, 12 bytes pad | payload (H fp8 or 2H bf16) | fp8: S f32 scales]
//                            combine:  rows [E][T_max] of 2H bytes (bf16), row (e, t) = expert e's output for t
//
//
// per_rank mode (EPConfig.low_latency_mode; one message per (token, destination rank)) uses the same half:
//   rank_words  u32[4][kMaxGroupRanks]  r_flags[s] / r_counts[s]: dispatch messages from source s (written by s);
//                                       w_flags[s]: combine weights from source s; p_flags[d]: combine partial
//                                       rows from rank d (written by d)
//   rows        dispatch: messages [R][T_max], rank_msg_stride bytes each:
//                 [header (kRankMsgHeader: source token, local expert and row position per top-k slot) |
//                  payload | scales]; d_counts[l][s] = rows of local expert l in source s's messages
//               combine: partial sums [R][T_max] of 2H bytes, row (d, t) = rank d's weighted sum for token t
//   weights     f32 [R][T_max][kMaxTopk]: source s's topk_weights, for the combine on the expert side
//
// Staged configs (EPConfig.allow_nvlink_for_low_latency=False: every row moves by NVSHMEM put-with-signal, the
// RDMA path of nvshmem/device/low_latency.cu) use the same halves and message layout, plus:
//   send     local send slots (the puts' sources must be symmetric memory): dispatch messages [T_max], or combine
//            rows [E][T_max] (row i of local expert l at l * R * T_max + i)
//   and, outside the halves at fixed offsets, the RDMA words: counted signals u64 [E] per half (dispatch: index
//   l * R + source; combine: the expert e) instead of d_flags / d_counts / c_flags, and consumed counters u64
//   [parity][source] instead of the header's consumed epochs.
//
// NOTE: every flag word has exactly one writer (d_flags[l][s], r_flags[s], r_counts[s], w_flags[s]: rank s;
// c_flags[e]: e's owner; p_flags[d]: rank d), so two writes to one word are ordered by that writer's stream, and a
// late write from an old epoch can never overwrite a newer one.
struct LowLatencyLayout {
  int64_t scratch;      // buffer offset of the scratch counters
  int64_t half[2];      // buffer offsets of the two halves
  int64_t c_flags;      // offsets inside a half
  int64_t d_flags;
  int64_t d_counts;
  int64_t rank_words;   // per_rank mode: r_flags, r_counts, w_flags, p_flags (kMaxGroupRanks u32 each)
  int64_t rows;
  int64_t weights;      // per_rank mode: f32 [R][T_max][kMaxTopk]
  int64_t msg_stride;   // dispatch message bytes
  int64_t rank_msg_stride;  // per_rank dispatch message bytes
  int64_t send;         // staged configs (NVSHMEM puts): offset inside a half of the local send slots, else 0
  int64_t send_bytes;   //   their bytes: dispatch messages [T_max], or combine rows [E][T_max] bf16 (the larger)
  int64_t half_needed;  // bytes this config needs in one half
  // RDMA words (buffer offsets; the same for every config, kLowLatencyNvshmemBytes after the scratch):
  int64_t nvshmem_consumed;   // u64 [2][kMaxGroupRanks]: ops of parity p received by rank s (ADD 1 each, never reset)
  int64_t nvshmem_signals[2]; // u64 [kMaxLowLatencyExperts] per half: counted signals (nvshmem/device/counted_signal.cuh)
};

// Word offsets inside rank_words (in u32 units).
struct RankWord {
  static constexpr int kFlags = 0, kCounts = kMaxGroupRanks, kWeightFlags = 2 * kMaxGroupRanks,
                       kPartialFlags = 3 * kMaxGroupRanks;
};

JAX_EP_HD int64_t low_latency_msg_stride(int64_t hidden) {
  const int64_t scale_cols = (hidden + kFp8Block - 1) / kFp8Block;
  return align_up(kLowLatencyMsgHeader + 2 * hidden + 4 * scale_cols, 16);
}

JAX_EP_HD int64_t low_latency_per_rank_msg_stride(int64_t hidden) {
  const int64_t scale_cols = (hidden + kFp8Block - 1) / kFp8Block;
  return align_up(kRankMsgHeader + 2 * hidden + 4 * scale_cols, 16);
}

// region_offset / half_bytes: where the LL region is and how big one half is (0, 0 for the size computation only).
// staged: the config sends through NVSHMEM puts, whose sources are local send slots in the symmetric buffer.
JAX_EP_HD LowLatencyLayout make_low_latency_layout(int64_t hidden, int64_t max_tokens_per_rank, int64_t num_experts,
                                                   int64_t num_ranks, int64_t region_offset, int64_t half_bytes,
                                                   bool staged = false) {
  LowLatencyLayout b{};
  const int64_t E = num_experts;
  b.c_flags = 0;
  b.d_flags = align_up(4 * E);
  b.d_counts = b.d_flags + align_up(8 * E);
  b.rank_words = b.d_counts + align_up(4 * E);
  b.rows = b.rank_words + align_up(4 * 4 * kMaxGroupRanks);
  b.msg_stride = low_latency_msg_stride(hidden);
  b.rank_msg_stride = low_latency_per_rank_msg_stride(hidden);
  const int64_t dispatch_end = b.rows + E * max_tokens_per_rank * b.msg_stride;  // L * R = E messages per token slot
  const int64_t combine_end = b.rows + E * max_tokens_per_rank * 2 * hidden;
  const int64_t rank_end = b.rows + num_ranks * max_tokens_per_rank * b.rank_msg_stride;  // per_rank: R per slot
  int64_t rows_end = dispatch_end > combine_end ? dispatch_end : combine_end;
  rows_end = rank_end > rows_end ? rank_end : rows_end;
  b.weights = align_up(rows_end);
  b.half_needed = align_up(b.weights + 4 * num_ranks * max_tokens_per_rank * kMaxTopk);
  b.send = b.send_bytes = 0;
  if (staged) {
    const int64_t combine_rows = E * max_tokens_per_rank * 2 * hidden;
    const int64_t messages = max_tokens_per_rank * (b.msg_stride > b.rank_msg_stride ? b.msg_stride : b.rank_msg_stride);
    b.send = b.half_needed;
    b.send_bytes = combine_rows > messages ? combine_rows : messages;
    b.half_needed = align_up(b.send + b.send_bytes);
  }
  b.scratch = region_offset;
  b.nvshmem_consumed = region_offset + kLowLatencyScratchBytes;
  b.nvshmem_signals[0] = b.nvshmem_consumed + kLowLatencyConsumedBytes;
  b.nvshmem_signals[1] = b.nvshmem_signals[0] + 8 * kMaxLowLatencyExperts;
  b.half[0] = region_offset + kLowLatencyFixedBytes;
  b.half[1] = b.half[0] + half_bytes;
  return b;
}

// Bytes of the low-latency region one rank needs for a config (both halves and the scratch).
inline int64_t low_latency_buffer_bytes(int64_t hidden, int64_t max_tokens_per_rank, int64_t num_ranks,
                                        int64_t num_experts, bool staged = false) {
  return kLowLatencyFixedBytes +
         2 * make_low_latency_layout(hidden, max_tokens_per_rank, num_experts, num_ranks, 0, 0, staged).half_needed;
}

// Bytes of one half inside an LL region of low_latency_bytes (what a bound region offers every config).
JAX_EP_HD int64_t low_latency_half_bytes(int64_t low_latency_bytes) {
  return low_latency_bytes > kLowLatencyFixedBytes ? (low_latency_bytes - kLowLatencyFixedBytes) / 2 / kAlign * kAlign : 0;
}

// ---- the plan -------------------------------------------------------------------------------------------------
struct StagingPlan {
  int64_t buffer_bytes;  // per device
  int64_t low_latency_offset;     // start of the LL region (= aligned end of the normal region, >= kSignalHeaderBytes)
  int64_t low_latency_bytes;      // LL region bytes, 0 when no config has LL buffers
};

// normal[i]: normal_buffer_bytes of config i; low_latency[j]: low_latency_buffer_bytes of config j with LL buffers.
// Values must be >= 0 (the module checks).
inline StagingPlan make_staging_plan(const int64_t* normal, size_t num_normal, const int64_t* low_latency,
                                     size_t num_low_latency) {
  int64_t normal_max = kSignalHeaderBytes;  // the header always exists
  for (size_t i = 0; i < num_normal; ++i) normal_max = normal[i] > normal_max ? normal[i] : normal_max;
  int64_t low_latency_max = 0;
  for (size_t i = 0; i < num_low_latency; ++i) low_latency_max = low_latency[i] > low_latency_max ? low_latency[i] : low_latency_max;
  StagingPlan p{};
  p.low_latency_offset = align_up(normal_max);
  p.low_latency_bytes = low_latency_max;
  p.buffer_bytes = p.low_latency_offset + align_up(low_latency_max);
  return p;
}

}  // namespace jax_ep
