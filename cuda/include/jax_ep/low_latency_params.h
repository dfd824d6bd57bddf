// Low-latency mode (decode, SPEC §4): the program-order protocol (state and token arrays) and the POD parameters of
// its kernels. The staging layout of the mode is in staging_layout.h, its header words in signal_header.h.
//
// ---- program order as data ------------------------------------------------------------------------------------
// state [4] s32 = [seq, in_flight, error, 0]: threaded through every LL op of a chain like a PRNG key (input =
//   last operand, output = last result, aliased). seq = LL ops the chain has run; in_flight = its sends not yet
//   received (0..2); error = bit mask, sticky.
// token [4] s32 = [epoch, T, error, 0]: what a send leaves for its own receive (epoch = the device epoch the op got,
//   0 when the send skipped; T = tokens of a dispatch send, 0 for a combine send; error = the send's output error).
//
// Transitions (the state words are read and written by the kernels, never by the host):
//   send    in_flight >= 2: error |= 1 (seq, in_flight unchanged); else seq += 1, in_flight += 1
//   fused   in_flight >= 2: error |= 1;                            else seq += 1
//   recv    in_flight -= 1 if > 0; error |= token.error
//   device  (CUDA only) a send or fused op whose error is still 0 and that finds in_flight_device >= 2 (the header
//           word SignalHeader::kLowLatencyInFlight: sends of all chains on this rank whose receive has not finished) sets
//           error |= 2 and prints one line naming the op and the rank.
// seq/in_flight/bits 0-1 depend on the state and token only, so the reference backend computes the same values.
// An op whose output error != 0 does NO work: no waits, no peer writes, no epoch, no change of in_flight_device,
// its data outputs are not written; it still writes its output state and (a send) a token carrying the error, so
// its receive skips too.
#pragma once

#include <cstdint>

#include "jax_ep/constants.h"
#include "jax_ep/group_ctx.h"
#include "jax_ep/macros.h"
#include "jax_ep/staging_layout.h"

namespace jax_ep::low_latency {

// Word indices of the state and token arrays.
struct StateWord {
  static constexpr int kSeq = 0, kInFlight = 1, kError = 2;
};
struct TokenWord {
  static constexpr int kEpoch = 0, kTokens = 1, kError = 2;
};
constexpr int kStateWords = 4;
constexpr int kTokenWords = 4;

// Error bits.
constexpr int32_t kErrorChain = 1;     // a third LL op while two of this chain are in flight
constexpr int32_t kErrorDevice = 2;    // the device already has two LL ops in flight (forked state, several chains)
constexpr int32_t kErrorUpstream = 4;  // reserved (an earlier op of the program failed)

struct ChainState {
  int32_t seq, in_flight, error;
};

JAX_EP_HD ChainState after_send(ChainState s) {
  if (s.in_flight >= kMaxLowLatencyInFlight) {
    s.error |= kErrorChain;
  } else {
    ++s.seq;
    ++s.in_flight;
  }
  return s;
}

JAX_EP_HD ChainState after_fused(ChainState s) {
  if (s.in_flight >= kMaxLowLatencyInFlight)
    s.error |= kErrorChain;
  else
    ++s.seq;
  return s;
}

JAX_EP_HD ChainState after_recv(ChainState s, int32_t token_error) {
  if (s.in_flight > 0) --s.in_flight;
  s.error |= token_error;
  return s;
}

// Group + low-latency region of one call (resolved and validated by the handler).
struct Ctx {
  GroupCtx g;                // peers, rank, R, timeout (g.layout unused)
  LowLatencyLayout low_latency;
  int32_t num_experts;       // E
  int32_t num_local;         // L = E / R
  int32_t hidden;            // H
  int32_t max_tokens;        // T_max
  int32_t sm_count;          // SMs of this device (grid sizing)
  RankMask remote_ranks;     // NVSHMEM kernels: rank q set = reached by NVSHMEM puts and signal ops only
                             // (another NVLink domain: remote_ranks()); clear = by stores through nvshmem_ptr
};

// The ranks of a group of R outside `rank`'s NVLink domain of nvl_domain ranks (domain of q: q / nvl_domain, the
// node of DeepEP's layout; the RDMA team is the ranks of one local index q % nvl_domain).
inline RankMask remote_ranks(int rank, int num_ranks, int nvl_domain) {
  RankMask mask = RankMask::none();
  for (int q = 0; q < num_ranks && q < kMaxGroupRanks; ++q)
    if (q / nvl_domain != rank / nvl_domain) mask.set(q);
  return mask;
}

// The state/token pointers every LL kernel takes. state_in and state_out may be the same buffer (the aliased
// operand/result pair): kernels read the input before any block writes the output (the last block writes it).
//   split send:  state_in/state_out = the op's state operand/result, token = the op's token result
//   split recv:  state_in/state_out = the op's state operand/result, token = the op's token operand
//   fused send:  state_in/state_out = the op's state operand/result, token = the header's fused-token slot
//   fused recv:  state_in = state_out = nullptr (the send wrote the final state), token = the fused-token slot
//   (per_expert fused ops on NVLink run as one kernel with the send's io and no token: low_latency_protocol.cuh,
//   fused_frame)
struct ChainIO {
  const int32_t* state_in;   // [4] s32 or nullptr
  int32_t* state_out;        // [4] s32 or nullptr
  int32_t* token;            // [4] s32: written by a send, read by a receive
};

// Dispatch send: one message per (token, distinct expert) straight into the owner's slot [l][me][position].
struct DispatchSendParams {
  Ctx c;
  ChainIO io;
  const void* x;             // [T, H] bf16
  const int32_t* topk_idx;   // [T, K]
  int32_t num_tokens;        // T
  int32_t num_topk;          // K
  bool use_fp8;              // quantize per 128 channels in the kernel (SPEC §4 rule) or send bf16
  bool fused;                // the send half of jax_ep_low_latency_dispatch (fused transition)
  bool per_rank;             // per_rank mode: one message per (token, destination rank) into [me][position]
};

// Dispatch receive: waits for every (local expert, source) signal and packs rows in (source, token) order.
struct DispatchRecvParams {
  Ctx c;
  ChainIO io;
  void* recv_x;              // [L, R*T_max, H] fp8 or bf16 out
  float* recv_x_scales;      // [L, R*T_max, S] f32 out (fp8), else nullptr
  int32_t* recv_count;       // [L] out
  int32_t* src_info;         // [L, R*T_max] out: source token, -1 on rows >= recv_count
  int32_t* layout_range;     // [L, R] out: rows from each source rank
  int32_t* msg_token;        // per_rank: [R, T_max] out (handle.msg_token), else nullptr
  int32_t* token_rows;       // per_rank: [R, T_max, K] out (handle.token_rows), else nullptr
  int32_t num_topk;          // K
  bool use_fp8;
  bool per_rank;             // per_rank mode: expand each source's messages into the local expert slots
};

// Combine send: every valid expert row back to its token's rank, slot [global expert][token].
struct CombineSendParams {
  Ctx c;
  ChainIO io;
  const void* expert_out;       // [L, R*T_max, H] bf16
  const int32_t* src_info;      // [L, R*T_max] (handle)
  const int32_t* layout_range;  // [L, R] (handle)
  // per_rank mode only (nullptr otherwise):
  const int32_t* msg_token;     // [R, T_max] (handle)
  const int32_t* token_rows;    // [R, T_max, K] (handle)
  const float* topk_weights;    // [T, K]: this rank's weights, pushed to every rank before the partial sums
  int32_t num_tokens;           // T
  int32_t num_topk;             // K
  bool fused;                   // the send half of jax_ep_low_latency_combine (fused transition)
  bool per_rank;                // per_rank mode: weighted partial sums per (token, rank) instead of expert rows
};

// Combine receive: y[t] = sum over valid k of w[t, k] * row(topk_idx[t, k], t), f32 accumulation, bf16 out.
struct CombineRecvParams {
  Ctx c;
  ChainIO io;
  const int32_t* topk_idx;   // [T, K]
  const float* topk_weights; // [T, K]
  void* y;                   // [T, H] bf16 out
  int32_t num_tokens;        // T
  int32_t num_topk;          // K
  bool per_rank;             // per_rank mode: y[t] = sum over t's ranks (ascending) of their partial sums
};

}  // namespace jax_ep::low_latency
