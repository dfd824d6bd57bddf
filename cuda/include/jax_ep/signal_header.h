// The fixed signal header at offset 0 of every rank's staging buffer: every device-side word of both modes, in one
// place. Peers write the arrays indexed by *their* rank; the single words are written by this rank only.
//
// NOTE: the header has a fixed size and never moves, so calls with different configs (different offsets for the
// regions after it) share one allocation: the barrier counters, epochs and flags persist across configs. The buffer
// is zeroed once at group creation; afterwards every counter only grows (wrap-safe compares) or is reset by the
// kernel that uses it, so no call ever resets anything from the host (CUDA-graph replay safe).
#pragma once

#include <cstdint>

#include "jax_ep/constants.h"

namespace jax_ep {

struct SignalHeader {
  // Per-rank arrays first (index = the writing peer s, kMaxGroupRanks entries), then the single words.
  static constexpr int64_t kU32PerRank = 4 * kMaxGroupRanks, kU64PerRank = 8 * kMaxGroupRanks;

  // ---- normal mode (cuda/kernels/normal_kernels.cu, cuda/transport/peer.cuh) ----
  static constexpr int64_t kBarrierIn = 0;                         // u32[R]: barrier arrivals of peer s, monotonic
  // u32[R]: epoch at which s published its counts (the NVSHMEM kernels; the NVLink ones send epoch words instead)
  static constexpr int64_t kCountFlag = kBarrierIn + kU32PerRank;
  static constexpr int64_t kDataFlag = kCountFlag + kU32PerRank;   // u32[R]: epoch at which s finished its rows here

  // ---- low-latency mode (cuda/kernels/low_latency_kernels.cu, low_latency_protocol.cuh) ----
  // u32[2][R]: consumed[h][s] = the last epoch of half h that rank s finished reading (written by s). Per half, so
  // two ops in flight may be received in either order; within a half, epochs n-2, n, n+2 are strictly sequential.
  static constexpr int64_t kLowLatencyConsumed = kDataFlag + kU32PerRank;

  // ---- normal mode over NVSHMEM (nvshmem/device/normal_send.cu): words of the pairs (s, this rank) with s remote
  // (GroupCtx::remote). Written by NVSHMEM signal ops of s only, never by GPU atomics: one mechanism per word.
  static constexpr int64_t kNvshmemBarrier = kLowLatencyConsumed + 2 * kU32PerRank;  // u64[R]: barrier arrivals of remote s
  static constexpr int64_t kNvshmemCount = kNvshmemBarrier + kU64PerRank;  // u64[R]: count puts of s landed (2; reset)
  static constexpr int64_t kNvshmemData = kNvshmemCount + kU64PerRank;     // u64[R]: s's rows delivered (announce; reset)

  // ---- single words, written by this rank only ----
  static constexpr int64_t kSingles = kNvshmemData + kU64PerRank;
  static constexpr int64_t kBarrierEpoch = kSingles;     // u32: normal-mode ops this rank entered = the op's epoch
  static constexpr int64_t kBlockDone = kSingles + 4;    // u32: last-block-done counter of the normal kernels that
                                                         // end in last_block (sends, push combine, combine's reduce,
                                                         // dispatch notify's blocks; NVLink and NVSHMEM kernels)
  static constexpr int64_t kLowLatencyEpoch = kSingles + 8;      // u32: epoch of the last LL send on this rank
  static constexpr int64_t kLowLatencySendDone = kSingles + 12;  // u32: last-block-done counter of the LL send kernels
  static constexpr int64_t kLowLatencyRecvDone = kSingles + 16;  // u32: last-block-done counter of the LL receive kernels
  // u32: in_flight_device = LL sends on this rank whose receive has not finished (all chains, all configs):
  // +1 by the last block of a send, -1 by the last block of a receive. A send that finds >= 2 skips (error bit 2).
  static constexpr int64_t kLowLatencyInFlight = kSingles + 20;
  // u32: barriers of the NVSHMEM normal kernels this rank completed (kNvshmemBarrier[s] counts those of s: only these
  // barriers signal remote peers, while kBarrierEpoch counts every barrier, the NVLink kernels' too).
  static constexpr int64_t kNvshmemEpoch = kSingles + 24;
  // u32: the next work item past the static first round (next_item, transport/peer.cuh) of the normal NVLink
  // dispatch send, of combine's reduce kernel and of push combine's senders, one atomic add per warp and item; the
  // kernel's last block (after every warp's final add) puts it back to 0.
  static constexpr int64_t kNextItem = kSingles + 28;
  // s32[4]: the token a fused op's send kernel leaves for its receive kernel (same layout as the token array).
  static constexpr int64_t kLowLatencyFusedToken = kSingles + 32;

  // ---- normal-mode combine over NVLink (cuda/kernels/normal_kernels.cu): CombineSource [2][kMaxNvlPeers], entry
  // [epoch & 1][s] written by rank s before the barrier of the combine with that epoch. Fixed place, whatever the
  // config; by parity, because a rank that has finished op n-1 publishes for op n while a peer may still read the
  // table of op n-1 (never of op n-2: the publisher passed barrier n-1, which the peer reached after op n-2).
  static constexpr int64_t kCombineSourceBytes = 16;
  static constexpr int64_t kCombineSources = kSingles + 64;

  // ---- normal-mode kernels over NVLink with two roles (cuda/kernels/normal_combine.cuh: combine_push_kernel;
  // normal_copy_out.cuh: send_copy_kernel): sender blocks and receiving blocks (reducers, copiers) ----
  // u32: the next receiving item past the static first round (taken by receiving blocks and by senders once done;
  // kNextItem is the senders' sending items).
  static constexpr int64_t kNextReceiveItem = kSingles + 48;
  // u32: role tickets: the first blocks of the kernel to start send, the others receive; read by senders done with
  // their sends (every_sender_started), put back to 0 by the grid's last block.
  static constexpr int64_t kRoleTicket = kSingles + 52;
  // u32: last-block-done counter of the sender blocks alone (send_copy_kernel: its last sender signals kDataFlag).
  static constexpr int64_t kSendBlocksDone = kSingles + 60;
  // u32: role tickets of the fused low-latency kernels (low_latency_protocol.cuh, fused_frame): the first blocks to
  // start send, the others receive; the receive's last block puts it back to 0. Like the LL done counters and the
  // epoch word, it assumes the LL kernels of one buffer run one at a time (one stream's order).
  static constexpr int64_t kLowLatencyRoleTicket = kSingles + 56;
  // u32 [kMaxNvlPeers][kArrivalChunks]: arrivals[s][c] = rows of chunk c (rows c * arrival_chunk_rows(T_max) ... of
  // rank s's rows for this rank) that rank s stored into this rank's staging this op, each add a release at system
  // scope after the rows it counts. Push combine: one add per chunk a sender item touches (1-4 rows), and the warp
  // of s's last row adds what its chunk lacks, so a chunk is complete at arrival_chunk_rows. Dispatch through
  // staging: one add per row, so a chunk is complete at its rows below the capacity (staged_chunk_rows). Zero
  // between ops: this rank's last block of the kernel puts every word back to 0 once every chunk it waited for is
  // complete, and a rank adds only after the next op's barrier or count exchange, which this rank enters after
  // that kernel.
  static constexpr int64_t kRowArrivals = 12288;
};

namespace signal_header_detail {

struct Word {
  int64_t offset, bytes, align;
};

// Every word of the header with its size; the static_asserts below check that none overlap and all fit.
constexpr Word kWords[] = {
    {SignalHeader::kBarrierIn, 4 * kMaxGroupRanks, 4},
    {SignalHeader::kBarrierEpoch, 4, 4},
    {SignalHeader::kCountFlag, 4 * kMaxGroupRanks, 4},
    {SignalHeader::kDataFlag, 4 * kMaxGroupRanks, 4},
    {SignalHeader::kBlockDone, 4, 4},
    {SignalHeader::kLowLatencyEpoch, 4, 4},
    {SignalHeader::kLowLatencySendDone, 4, 4},
    {SignalHeader::kLowLatencyRecvDone, 4, 4},
    {SignalHeader::kLowLatencyInFlight, 4, 4},
    {SignalHeader::kLowLatencyFusedToken, 16, 16},  // read and written as one 16-byte vector
    {SignalHeader::kLowLatencyConsumed, 4 * 2 * kMaxGroupRanks, 4},
    {SignalHeader::kNvshmemBarrier, 8 * kMaxGroupRanks, 8},
    {SignalHeader::kNvshmemCount, 8 * kMaxGroupRanks, 8},
    {SignalHeader::kNvshmemData, 8 * kMaxGroupRanks, 8},
    {SignalHeader::kNvshmemEpoch, 4, 4},
    {SignalHeader::kNextItem, 4, 4},
    {SignalHeader::kCombineSources, 2 * kMaxNvlPeers * SignalHeader::kCombineSourceBytes, 16},
    {SignalHeader::kNextReceiveItem, 4, 4},
    {SignalHeader::kRoleTicket, 4, 4},
    {SignalHeader::kSendBlocksDone, 4, 4},
    {SignalHeader::kLowLatencyRoleTicket, 4, 4},
    {SignalHeader::kRowArrivals, 4 * kMaxNvlPeers * kArrivalChunks, 4},
};

constexpr bool fits_and_aligned() {
  for (const Word& w : kWords)
    if (w.offset < 0 || w.offset + w.bytes > kSignalHeaderBytes || w.offset % w.align != 0) return false;
  return true;
}

constexpr bool disjoint() {
  const int n = sizeof(kWords) / sizeof(kWords[0]);
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j)
      if (kWords[i].offset < kWords[j].offset + kWords[j].bytes &&
          kWords[j].offset < kWords[i].offset + kWords[i].bytes)
        return false;
  return true;
}

static_assert(fits_and_aligned(), "a signal header word lies outside kSignalHeaderBytes or is misaligned");
static_assert(disjoint(), "two signal header words overlap");
static_assert(kSignalHeaderBytes % kAlign == 0, "the header must end on a region boundary");

}  // namespace signal_header_detail
}  // namespace jax_ep
