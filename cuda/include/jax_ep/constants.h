// Limits the kernels are written for and the fixed sizes of the staging buffer. Handlers validate against these and
// return an error naming the limit.
#pragma once

#include <cstdint>

namespace jax_ep {

// ---- routing (the layout target and the dispatch notify kernel) ----
constexpr int kMaxLayoutExperts = 8192;    // CUDA: per-expert counters live in shared memory (32 KB)
constexpr int kLayoutThreads = 1024;       // one block computes a layout (T <= 8192 in practice: a few us)
// Dispatch notify on the NVLink path: blocks of kNotifyThreads, each laying out one chunk of consecutive tokens
// (notify_chunk_tokens), at most kMaxNotifyBlocks of them; the last block to finish exchanges the counts.
constexpr int kNotifyThreads = 256;
constexpr int kMaxNotifyBlocks = 32;

// Tokens per notify block for T tokens: whole tiles of kNotifyThreads, as few per block as kMaxNotifyBlocks allow.
constexpr int notify_chunk_tokens(int num_tokens) {
  const int tiles = (num_tokens + kNotifyThreads - 1) / kNotifyThreads;
  const int per_block = (tiles + kMaxNotifyBlocks - 1) / kMaxNotifyBlocks;
  return (per_block > 0 ? per_block : 1) * kNotifyThreads;
}

// ---- groups (both modes) ----
// R, ranks per EP group: the per-rank words of the signal header and the rank masks (RankMask, rank_mask.h) are
// sized for it; loops over ranks stride by the block or warp size. EP256 = 32 hosts of 8 GPUs.
constexpr int kMaxGroupRanks = 256;
// Ranks one group reaches by load/store on the NVLink normal-mode path (the per-token destination arrays of its
// send kernel): that path runs for R <= num_max_nvl_peers <= 8; wider groups take the NVSHMEM kernels.
constexpr int kMaxNvlPeers = 8;
constexpr int kMaxTopk = 16;               // K

// ---- staging buffer (cuda/include/jax_ep/staging_layout.h) ----
constexpr int64_t kAlign = 256;            // every region of the staging buffer starts on this boundary
constexpr int64_t kFp8Block = 128;         // channels per fp8 scale (SPEC §4)
constexpr int64_t kSignalHeaderBytes = 16384;  // fixed header at offset 0 (cuda/include/jax_ep/signal_header.h)
// The NVLink kernels that receive while they send (push combine, dispatch through staging) count arrived rows per
// (source rank, chunk of its rows), kArrivalChunks chunks of arrival_chunk_rows(T_max) rows per source, so the
// receiving blocks start on a row (reduce, copy-out) once the chunk that holds it is in.
constexpr int kArrivalChunks = 128;
constexpr int arrival_chunk_rows(int max_tokens_per_rank) {
  const int rows = (max_tokens_per_rank + kArrivalChunks - 1) / kArrivalChunks;
  return rows > 0 ? rows : 1;
}

// ---- low-latency mode ----
constexpr int64_t kMaxLowLatencyExperts = 1024;  // E <= 1024
// Scratch counters of the send kernels: u32 per expert (kMaxLowLatencyExperts), then u32 per rank (kMaxGroupRanks:
// per_rank mode's messages per destination).
constexpr int64_t kLowLatencyScratchRanks = kMaxLowLatencyExperts;  // word index of the per-rank counters
constexpr int64_t kLowLatencyScratchBytes = 4 * (kMaxLowLatencyExperts + kMaxGroupRanks);
constexpr int64_t kLowLatencyMsgHeader = 16;     // bytes before the payload of a dispatch message
// per_rank mode's message header: i32 token, 12 pad | i32 local expert per top-k slot (-1: none here), kMaxTopk |
// i32 row position per top-k slot (the token's place among this source's rows of that expert, -1: none), kMaxTopk.
constexpr int64_t kRankMsgLocalExperts = 16;
constexpr int64_t kRankMsgPositions = kRankMsgLocalExperts + 4 * kMaxTopk;
constexpr int64_t kRankMsgHeader = kRankMsgPositions + 4 * kMaxTopk;
constexpr int32_t kMaxLowLatencyInFlight = 2;    // LL ops between their send and their receive (buffer halves)
// The RDMA words of the LL region (NVSHMEM puts, EPConfig.allow_nvlink_for_low_latency=False), at offsets that do
// not depend on the config, so every config of an axis finds them at the same place: consumed counters u64
// [2 parities][kMaxGroupRanks] (a whole number of 256-byte blocks), then counted signals u64 [2 halves]
// [kMaxLowLatencyExperts].
constexpr int64_t kLowLatencyConsumedBytes = (2 * 8 * kMaxGroupRanks + 255) / 256 * 256;
constexpr int64_t kLowLatencyNvshmemBytes = kLowLatencyConsumedBytes + 2 * 8 * kMaxLowLatencyExperts;
// Bytes at the start of every LL region, before the two halves: scratch counters, then the RDMA words.
constexpr int64_t kLowLatencyFixedBytes = kLowLatencyScratchBytes + kLowLatencyNvshmemBytes;

}  // namespace jax_ep
