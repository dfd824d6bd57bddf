// Device side of the low-latency protocol: epochs and buffer halves (staging_layout.h), the per-half consumed
// words, and the program-order state/token of low_latency_params.h. Used by the four LL kernels (low_latency_kernels.cu) only.
//
// Every LL kernel is  open (thread 0 of every block: read the state/token, decide) -> body (only when the op works)
// -> finish (the last block to finish writes the output state and advances the device words).
// NOTE (why the decision is the same in every block): each block reads the input state, the token and the header
// words kLowLatencyEpoch / kLowLatencyInFlight at its start; the only writer of the output state (which may be the input buffer
// itself: the aliased operand/result pair) and of those header words is the last block of the kernel, which writes
// after every block has counted itself done, i.e. after every block's reads. Between kernels, stream order.
#pragma once

#include <cstdint>
#include <cstdio>

#include "common/last_block.cuh"
#include "common/ptx.cuh"
#include "common/thread.cuh"
#include "jax_ep/low_latency_params.h"
#include "jax_ep/signal_header.h"
#include "kernels/low_latency_phases.cuh"
#include "transport/peer.cuh"

namespace jax_ep::low_latency {

// A kernel's decision, computed by thread 0 of each block into shared memory (block-uniform).
struct Gate {
  int4 state_out;   // [seq, in_flight, error, 0]: what the last block writes to io.state_out (if any)
  uint32_t epoch;   // the op's epoch (0 when it skips)
  int32_t work;     // 0: skip everything (output error != 0)
};

__device__ __forceinline__ uint32_t* low_latency_word(const GroupCtx& g, int64_t header_offset) {
  return header_word(self_base(g), header_offset);
}

__device__ __forceinline__ uint32_t load_volatile(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

// Buffer offset of the half used by the op of `epoch`. NOTE: a select, not half[epoch & 1]: a dynamic index into a
// by-value kernel parameter would copy the struct to local memory.
__device__ __forceinline__ int64_t half_offset(const LowLatencyLayout& low_latency, uint32_t epoch) {
  return (epoch & 1u) ? low_latency.half[1] : low_latency.half[0];
}

// Before writing into peer d's half for epoch n: d has finished reading op n-2 from that half.
__device__ __forceinline__ void wait_consumed(const GroupCtx& g, int d, uint32_t epoch) {
  wait_reached(low_latency_word(g, SignalHeader::kLowLatencyConsumed + 4 * (kMaxGroupRanks * (epoch & 1u) + d)), epoch - 2u,
               g.timeout_ns, "low-latency send (peer still reading the op two epochs back)", g.rank, d);
}

// Ops of op n's parity that come before it (epochs n-2, n-4, ..., >= 1): the count every rank's consumed counter of
// that parity must reach before op n writes into its half (NVSHMEM path: ADD-only counters instead of epochs).
// NOTE: epochs are u32; after 2^32 LL ops on one device this count (and the NVLink path's wrap-safe compare of
// epochs) would need a wider epoch.
__device__ __forceinline__ uint64_t consumed_target(uint32_t n) { return n >= 1u ? (n - 1u) / 2u : 0u; }

// The decision of a send (thread 0 of each block; no side effects): the output state and, when it works, the op's
// epoch. `device_error` tells whether the device check (below) failed, for the caller's message.
// nvshmem_consumed: the NVSHMEM path's consumed counters (u64 [2][kMaxGroupRanks], LowLatencyLayout::nvshmem_consumed),
// nullptr on the NVLink path (the header's consumed epochs).
// NOTE (state words): the input state and the token are XLA buffers written by earlier kernels of the stream; read
// with ld.global.cg (never a stale L1 line).
__device__ __forceinline__ void send_decision(const GroupCtx& g, const ChainIO& io, bool fused, Gate* gate,
                                              bool* device_error, const uint64_t* nvshmem_consumed = nullptr) {
  const int4 in4 = __ldcg(reinterpret_cast<const int4*>(io.state_in));
  const ChainState in{in4.x, in4.y, in4.z};
  ChainState out = fused ? after_fused(in) : after_send(in);
  *device_error = false;
  if (out.error == 0) {
    // NOTE (in_flight_device): +1 by the last block of every send, -1 by the last block of every receive (both only
    // when the op works), so it counts this rank's LL ops between send and receive over all chains and configs.
    // Two is the most the buffer halves allow; a third would overwrite data a peer has not read yet.
    // NOTE (own consumed word): this send's half still holds op n-2 until this rank's own receive of n-2 has run.
    // That receive is earlier on this stream or later; if later, waiting for it (wait_consumed) would deadlock, so
    // a send whose n-2 is not consumed here is a misordered program: skip it with the error instead. This also
    // covers two sends in flight with a third coming (in_flight_device >= 2), and a receive of n-2 queued behind a
    // later one (independent chains).
    const uint32_t dev = load_volatile(low_latency_word(g, SignalHeader::kLowLatencyInFlight));
    const uint32_t next = load_volatile(low_latency_word(g, SignalHeader::kLowLatencyEpoch)) + 1u;
    bool own_consumed;
    if (nvshmem_consumed != nullptr) {
      own_consumed = *reinterpret_cast<const volatile uint64_t*>(nvshmem_consumed + kMaxGroupRanks * (next & 1u) +
                                                                 g.rank) >= consumed_target(next);
    } else {
      const uint32_t own = load_volatile(
          low_latency_word(g, SignalHeader::kLowLatencyConsumed + 4 * (kMaxGroupRanks * (next & 1u) + g.rank)));
      own_consumed = reached(own, next - 2u);
    }
    if (dev >= static_cast<uint32_t>(kMaxLowLatencyInFlight) || !own_consumed) {
      out.error |= kErrorDevice;
      *device_error = true;
    }
  }
  gate->state_out = make_int4(out.seq, out.in_flight, out.error, 0);
  gate->work = out.error == 0;
  // Epoch of the op being sent: one more than the last send on this rank (set at the end of every working send).
  gate->epoch = gate->work ? load_volatile(low_latency_word(g, SignalHeader::kLowLatencyEpoch)) + 1u : 0u;
}

// The device over-subscription message (once per op: one thread of the send). `op` names the op.
__device__ __forceinline__ void print_device_error(const GroupCtx& g, const char* op) {
  printf("jax_ep: %s on rank %d skipped (error bit 2): %u low-latency ops in flight, op %u not yet received "
         "here: the program forked the LL state or ran LL ops on independent chains\n",
         op, g.rank, load_volatile(low_latency_word(g, SignalHeader::kLowLatencyInFlight)),
         load_volatile(low_latency_word(g, SignalHeader::kLowLatencyEpoch)) - 1u);
}

// Thread 0 of each block of a send kernel. `op` names the op in the device over-subscription message.
__device__ __forceinline__ void open_send(const GroupCtx& g, const ChainIO& io, bool fused, int32_t num_tokens,
                                          const char* op, Gate* gate, const uint64_t* nvshmem_consumed = nullptr) {
  bool device_error = false;
  send_decision(g, io, fused, gate, &device_error, nvshmem_consumed);
  if (device_error && blockIdx.x == 0 && blockIdx.y == 0) print_device_error(g, op);
  if (blockIdx.x == 0 && blockIdx.y == 0)
    *reinterpret_cast<int4*>(io.token) = make_int4(static_cast<int32_t>(gate->epoch), num_tokens,
                                                   gate->state_out.z, 0);  // read by the op's receive
}

// Thread 0 of each block of a receive kernel (split: state_in != nullptr; fused: the send wrote the state).
__device__ __forceinline__ void open_recv(const ChainIO& io, Gate* gate) {
  const int4 tok = __ldcg(reinterpret_cast<const int4*>(io.token));
  ChainState out{0, 0, tok.z};
  if (io.state_in != nullptr) {
    const int4 in4 = __ldcg(reinterpret_cast<const int4*>(io.state_in));
    out = after_recv(ChainState{in4.x, in4.y, in4.z}, tok.z);
  }
  gate->state_out = make_int4(out.seq, out.in_flight, out.error, 0);
  // NOTE: a receive works iff its own send worked (token error 0), whatever the chain's error says: the data of a
  // send that happened is received and its half marked consumed, so in_flight_device comes back down and the
  // device recovers from a misordered program without a new initialize (the chain state keeps the error).
  gate->work = tok.z == 0 && tok.x != 0;
  gate->epoch = static_cast<uint32_t>(tok.x);
}

// Called by every thread of each of `blocks` blocks (the kernel's grid, or a fused kernel's receive role) once per
// block at its end. Returns true in thread 0 of the last block to get here, after every other block got here (and
// after their reads and writes: fenced).
__device__ __forceinline__ bool last_block_done(uint32_t* counter, uint32_t blocks) {
  __syncthreads();
  if (threadIdx.x != 0) return false;
  __threadfence();  // this block's loads (state, token, half) and stores are complete before it is counted
  if (atomicAdd(counter, 1u) != blocks - 1) return false;
  atomicExch(counter, 0u);  // every block has counted itself: reset for the next kernel
  __threadfence();
  return true;
}

__device__ __forceinline__ void write_state(const ChainIO& io, const Gate& gate) {
  if (io.state_out != nullptr) *reinterpret_cast<int4*>(io.state_out) = gate.state_out;
}

// End of every send kernel (all threads of all blocks): the last block advances this rank's epoch counter and
// in_flight_device (working op) and writes the output state (finish_send_last: thread 0 of the last block).
__device__ __forceinline__ void finish_send_last(const GroupCtx& g, const ChainIO& io, const Gate& gate) {
  if (gate.work) {
    *reinterpret_cast<volatile uint32_t*>(low_latency_word(g, SignalHeader::kLowLatencyEpoch)) = gate.epoch;
    atomicAdd(low_latency_word(g, SignalHeader::kLowLatencyInFlight), 1u);
  }
  write_state(io, gate);
}

__device__ __forceinline__ void finish_send(const GroupCtx& g, const ChainIO& io, const Gate& gate) {
  if (last_block_done(low_latency_word(g, SignalHeader::kLowLatencySendDone), gridDim.x * gridDim.y))
    finish_send_last(g, io, gate);
}

// Thread 0 of a receive's last block, after it published the consumed epoch: in_flight_device -= 1, the state.
__device__ __forceinline__ void end_recv(const GroupCtx& g, const ChainIO& io, const Gate& gate) {
  if (gate.work) {
    // NOTE: never below 0 (a receive whose send predates the group's zeroing cannot exist, but stay saturating).
    uint32_t* dev = low_latency_word(g, SignalHeader::kLowLatencyInFlight);
    uint32_t cur = load_volatile(dev);
    while (cur > 0u) {
      const uint32_t seen = atomicCAS(dev, cur, cur - 1u);
      if (seen == cur) break;
      cur = seen;
    }
  }
  write_state(io, gate);
}

// End of every receive kernel on the NVLink path (every thread of every block): once all blocks have read their part
// of the half, the last block's threads tell every rank (this one too) in parallel that epoch n is consumed here (the
// epoch, a release store into its header through the peer pointer: it orders the block's reads, and through the
// blocks' fences and counts every block's), so their op n+2 may reuse the half; then end_recv. (The NVSHMEM path:
// nvshmem/device/low_latency.cu.)
// blocks: the receive's blocks (the kernel's grid, or a fused kernel's receive role); end: thread 0 of the last block
// after the release (end_recv, or the fused kernel's end_fused); settle(epoch): every thread of the last block, before
// the release, when the op works (a fused kernel whose send blocks read this rank's half: until they are done).
struct NoSettle {
  __device__ __forceinline__ void operator()(uint32_t) const {}
};
template <typename End, typename Settle = NoSettle>
__device__ __forceinline__ void finish_recv(const GroupCtx& g, const Gate& gate, uint32_t blocks, End end,
                                            Settle settle = {}) {
  __shared__ bool s_last;
  const bool last = last_block_done(low_latency_word(g, SignalHeader::kLowLatencyRecvDone), blocks);
  if (threadIdx.x == 0) s_last = last;
  __syncthreads();
  if (!s_last) return;
  phase_stamp(g_ll_phases, kPhaseRecvLast);
  if (gate.work) settle(gate.epoch);
  if (gate.work)
    for (int d = threadIdx.x; d < g.num_ranks; d += blockDim.x)
      st_release_sys(header_word(peer_base(g, d),
                                 SignalHeader::kLowLatencyConsumed + 4 * (kMaxGroupRanks * (gate.epoch & 1u) + g.rank)),
                     gate.epoch);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseRecvReleased);
  if (threadIdx.x == 0) end();
}

// The frame of every receive kernel: open (block-uniform decision), body(epoch) only when the op works, finish.
template <typename Params, typename Body>
__device__ __forceinline__ void receive_frame(const Params& p, Body body) {
  __shared__ Gate s_gate;
  phase_begin(g_ll_phases);
  if (threadIdx.x == 0) open_recv(p.io, &s_gate);
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseRecvOpened);
  if (s_gate.work) body(s_gate.epoch);  // block-uniform
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseRecvBody);
  finish_recv(p.c.g, s_gate, gridDim.x * gridDim.y, [&] { end_recv(p.c.g, p.io, s_gate); });
}

// ---- a fused op in one kernel (dispatch or combine without the split: low_latency_kernels.cu) ----
// The first `senders` blocks to start (a ticket, SignalHeader::kLowLatencyRoleTicket) play the send, with places
// 0..senders-1; the others play the receive, with places 0..(grid - senders - 1). The send's last block publishes the
// flags and writes nothing else; the receive's last block releases "consumed" as a receive does, then ends the op:
// the role ticket back to 0, the epoch word, the output state (end_fused).
// NOTE (progress): receive blocks spin on flags. Every send place belongs to a block that has started (places go by
// ticket), and send blocks wait for nothing but peers' reads of op n-2 (earlier kernels) and, in the per_rank
// combine, peers' weight pushes, which each peer's send place 0 makes after those reads alone; so every flag a
// send or receive block waits for is raised, on this GPU and on every peer.
// NOTE (one decision): every block decides at its start (send_decision, fused transition) from the input state, the
// epoch word and its own consumed word, then takes its role ticket (acq_rel: the decision's loads before it). The
// writers of those words are the receive's last block alone, which goes on after every receive block counted itself
// done; the last ticket went to a receive block, which acquired every earlier ticket; so every block has decided
// before any of them is written, and all decide alike.
// in_flight_device is not changed: the op is never between its send and its receive outside the kernel.
__device__ __forceinline__ void end_fused(const GroupCtx& g, const ChainIO& io, const Gate& gate) {
  *low_latency_word(g, SignalHeader::kLowLatencyRoleTicket) = 0u;
  if (gate.work)
    *reinterpret_cast<volatile uint32_t*>(low_latency_word(g, SignalHeader::kLowLatencyEpoch)) = gate.epoch;
  write_state(io, gate);
}

// Every thread of every block of a fused kernel. send(epoch, place) and receive(epoch, receive_place, receive_blocks)
// are the bodies (called only when the op works); publish(epoch): the send's last block, after every send block;
// settle(epoch): the receive's last block before it releases "consumed" (finish_recv): a send that reads this rank's
// half waits there until its blocks are done, or a peer's op n+2 could overwrite what they read.
template <typename Send, typename Publish, typename Receive, typename Settle = NoSettle>
__device__ __forceinline__ void fused_frame(const GroupCtx& g, const ChainIO& io, const char* op, int senders,
                                            Send send, Publish publish, Receive receive, Settle settle = {}) {
  __shared__ Gate s_gate;
  __shared__ int32_t s_role;
  __shared__ int32_t s_last;
  phase_begin(g_ll_phases);
  if (threadIdx.x == 0) {
    bool device_error = false;
    send_decision(g, io, true, &s_gate, &device_error);
    s_role = static_cast<int32_t>(atom_add_acq_rel_gpu(low_latency_word(g, SignalHeader::kLowLatencyRoleTicket), 1u));
    if (device_error && s_role == 0) print_device_error(g, op);
  }
  __syncthreads();
  const int role = s_role;
  if (role < senders) {
    phase_stamp(g_ll_phases, kPhaseSendOpened);
    if (s_gate.work) send(s_gate.epoch, role);  // block-uniform
    __syncthreads();
    phase_stamp(g_ll_phases, kPhaseSendBody);
    if (!last_block<TicketScope::kGpu>(low_latency_word(g, SignalHeader::kLowLatencySendDone), &s_last,
                                       static_cast<uint32_t>(senders)))
      return;
    phase_stamp(g_ll_phases, kPhaseSendLast);
    if (s_gate.work) publish(s_gate.epoch);
    __syncthreads();
    phase_stamp(g_ll_phases, kPhaseSendPublished);
    return;
  }
  const int receivers = static_cast<int>(gridDim.x) - senders;
  phase_stamp(g_ll_phases, kPhaseRecvOpened);
  if (s_gate.work) receive(s_gate.epoch, role - senders, receivers);  // block-uniform
  __syncthreads();
  phase_stamp(g_ll_phases, kPhaseRecvBody);
  finish_recv(g, s_gate, static_cast<uint32_t>(receivers), [&] { end_fused(g, io, s_gate); }, settle);
}

}  // namespace jax_ep::low_latency
