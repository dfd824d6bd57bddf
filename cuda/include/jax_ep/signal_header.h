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
  // ---- normal mode (cuda/kernels/normal_kernels.cu, cuda/transport/peer.cuh) ----
  static constexpr int64_t kBarrierIn = 0;      // u32[8]: barrier arrivals of peer s, monotonic, one per op
  static constexpr int64_t kBarrierEpoch = 32;  // u32: barriers this rank completed = the current op's epoch
  static constexpr int64_t kCountFlag = 64;     // u32[8]: epoch at which peer s published its counts
  static constexpr int64_t kDataFlag = 128;     // u32[8]: epoch at which peer s finished writing rows here
  static constexpr int64_t kBlockDone = 192;    // u32: last-block-done counter of the sending kernels (reset by it)

  // ---- low-latency mode (cuda/kernels/ll_kernels.cu, ll_protocol.cuh) ----
  static constexpr int64_t kLlEpoch = 256;      // u32: epoch of the last LL send on this rank
  static constexpr int64_t kLlSendDone = 260;   // u32: last-block-done counter of the send kernels (reset by it)
  static constexpr int64_t kLlRecvDone = 264;   // u32: last-block-done counter of the receive kernels (reset by it)
  // u32: in_flight_device = LL sends on this rank whose receive has not finished (all chains, all configs):
  // +1 by the last block of a send, -1 by the last block of a receive. A send that finds >= 2 skips (error bit 2).
  static constexpr int64_t kLlInFlight = 268;
  // s32[4]: the token a fused op's send kernel leaves for its receive kernel (same layout as the token array).
  static constexpr int64_t kLlFusedToken = 272;
  // u32[2][8]: consumed[h][s] = the last epoch of half h that rank s finished reading (written by s). Per half, so
  // two ops in flight may be received in either order; within a half, epochs n-2, n, n+2 are strictly sequential.
  static constexpr int64_t kLlConsumed = 288;

  // ---- normal mode over NVSHMEM (nvshmem/device/normal_rdma.cu): words of the pairs (s, this rank) with s remote
  // (GroupCtx::remote). Written by NVSHMEM signal ops of s only, never by GPU atomics: one mechanism per word.
  static constexpr int64_t kRdmaBarrier = 384;  // u64[8]: barrier arrivals of remote peer s (+1 per op, monotonic)
  static constexpr int64_t kRdmaCount = 448;    // u64[8]: count puts of remote peer s landed (2 per dispatch; reset)
  static constexpr int64_t kRdmaData = 512;     // u64[8]: remote peer s's rows delivered (announce; reset by the wait)
  // u32: barriers of the NVSHMEM kernels this rank completed (kRdmaBarrier[s] counts those of s: only these
  // barriers signal remote peers, while kBarrierEpoch counts every barrier, the NVLink kernels' too).
  static constexpr int64_t kRdmaEpoch = 576;
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
    {SignalHeader::kLlEpoch, 4, 4},
    {SignalHeader::kLlSendDone, 4, 4},
    {SignalHeader::kLlRecvDone, 4, 4},
    {SignalHeader::kLlInFlight, 4, 4},
    {SignalHeader::kLlFusedToken, 16, 16},  // read and written as one 16-byte vector
    {SignalHeader::kLlConsumed, 4 * 2 * kMaxGroupRanks, 4},
    {SignalHeader::kRdmaBarrier, 8 * kMaxGroupRanks, 8},
    {SignalHeader::kRdmaCount, 8 * kMaxGroupRanks, 8},
    {SignalHeader::kRdmaData, 8 * kMaxGroupRanks, 8},
    {SignalHeader::kRdmaEpoch, 4, 4},
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
