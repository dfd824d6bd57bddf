// Low-latency dispatch and combine over NVSHMEM (EPConfig.allow_nvlink_for_low_latency=False): the RDMA leg of
// docs/INTERNODE.md. per_expert mode. Every row moves in counted messages (dispatch: put_part_bytes, 8 KB by
// default; combine: 2 KB segments to direct ranks, staged rows in parts of at most put_part_bytes to the others)
// into the slot the NVLink kernels (cuda/kernels/low_latency_kernels.cu) store into, with the same halves, epochs,
// state/token protocol and outputs; what differs is how data and completion travel:
//   rows        to a remote peer (another NVLink domain, or no load/store mapping): from a local send slot of the
//               symmetric buffer (a remote put's source must be symmetric or registered memory) with
//               nvshmemx_putmem_signal_nbi_warp; to a direct peer (same NVLink domain with an nvshmem_ptr mapping,
//               this rank included): stores through that pointer and a system-scope GPU atomic ("one mechanism per
//               counted word" below says which peer is which and why not NVSHMEM's own atomics);
//   completion  counted signals (counted_signal.cuh): u64 words at the receiver, one per (local expert, source) for
//               dispatch and per expert for combine, each message ADDs 1 after its bytes, the sender announces its
//               count with one signal ADD; no flag SET (IBRC/UCX need GDRCopy for it) and no fence before counts;
//   consumed    u64 counters per (parity, source) that every receiver ADDs 1 to once it has read op n, at every rank;
//               a sender of op n waits until each peer's counter of n's parity reached consumed_target(n).
// Launched through the LowLatencyNvshmemOps table (jax_ep/nvshmem_ops.h) by the handlers of jax_ep._jax_ep_native.
// NOTE (memory ordering): a receiver sees a word complete with volatile loads, runs NVSHMEM's wait once (the
// transport's consistency step) and fences at system scope before it reads the rows; a sender's message is complete
// in its send slot (__syncthreads or __syncwarp, then __threadfence) before the put reads it; a direct message's
// stores are fenced at system scope before its count. INVARIANT: NVSHMEM signal ops only for remote ranks; counts of
// NVLink peers and of this rank are GPU stores/atomics (a signal op to a direct peer may go through the proxy or NIC
// in a multi-node job, and mixing it with GPU atomics on one word loses counts).
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/preload.cuh"
#include "device/counted_signal.cuh"
#include "device/low_latency.h"
#include "device/phase_stamps.cuh"
#include "device/remote_puts.cuh"
#include "kernels/low_latency_device.cuh"
#include "kernels/low_latency_protocol.cuh"
#include "kernels/low_latency_recv.cuh"

namespace jax_ep::nvshmem {

// The test hook's byte counter (remote_puts.cuh).
__device__ uint32_t g_count_remote_bytes;
// Test hook JAX_EP_TEST_ALL_PEERS_REMOTE=1 on the device (preload_kernels arms it): the dispatch send treats every
// peer as one reached through a proxy or NIC, so its wait-before-staging path runs on one host too.
__device__ uint32_t g_test_all_peers_remote;
__device__ unsigned long long g_remote_bytes;
// The phase sums of the test hook (phase_stamps.cuh).
__device__ PhaseSums g_low_latency_phases;

namespace {

using namespace jax_ep::low_latency;  // NOLINT

// The counted-signal words of op `epoch`'s half, as this device addresses them (the same symmetric offset at every
// PE). NOTE: a select, not nvshmem_signals[epoch & 1] (a dynamic index into a by-value parameter spills it).
__device__ __forceinline__ uint64_t* signal_words(const Ctx& c, uint32_t epoch) {
  return reinterpret_cast<uint64_t*>(self_base(c.g) + ((epoch & 1u) ? c.low_latency.nvshmem_signals[1] : c.low_latency.nvshmem_signals[0]));
}

__device__ __forceinline__ uint64_t* consumed_words(const Ctx& c) {
  return reinterpret_cast<uint64_t*>(self_base(c.g) + c.low_latency.nvshmem_consumed);
}

// A bounded wait for a complete counted signal; after c.g.timeout_ns it prints who waited for what and traps.
// No fence: for words whose data is not read afterwards (wait_signal fences).
__device__ __forceinline__ uint64_t wait_signal_relaxed(uint64_t* word, const Ctx& c, const char* what, int index) {
  uint64_t seen = 0;
  if (!wait_complete(word, c.g.timeout_ns, &seen)) {
    if (first_timeout_report())
      printf("jax_ep: timeout after %llu ns in %s on rank %d: signal %d has %u messages, announced %d; a peer is "
             "missing or runs another program. Trapping.\n",
             static_cast<unsigned long long>(c.g.timeout_ns), what, c.g.rank, index, static_cast<uint32_t>(seen),
             static_cast<int>(seen >> kAnnounceShift) - 1);
    __trap();
  }
  return seen;
}

__device__ __forceinline__ uint64_t wait_signal(uint64_t* word, const Ctx& c, const char* what, int index) {
  const uint64_t seen = wait_signal_relaxed(word, c, what, index);
  // NVSHMEM's wait (returns at once: the word is complete) also runs the transport's consistency step, which on
  // proxy transports without ordered delivery (PROXY_CST jobs) makes the NIC's data writes visible before the rows
  // are read; a plain volatile load of the signal does not.
  nvshmem_signal_wait_until(word, NVSHMEM_CMP_GE, seen);
  __threadfence_system();  // the rows the signal vouches for are read after it
  return seen;
}

// ---- one mechanism per counted word ------------------------------------------------------------------------------
// NVSHMEM turns a signal ADD into a GPU atomic through the P2P pointer only when the whole JOB is load/store connected
// (nvshmemi_device_state_d.job_connectivity <= NVSHMEMI_JOB_GPU_LDST); in a job with any remote PE every signal op goes
// through the proxy or the NIC, for NVLink peers and this PE too. A NIC atomic is not atomic with a GPU atomic on the
// same word. So each word has one mechanism, decided by the pair (sender, receiver): a peer of this rank's NVLink
// domain (c.remote_ranks bit clear: r / nvl_domain equal, EPConfig.low_latency_nvl_domain) with a load/store mapping
// (host nvshmem_ptr non-null, peers.base) is "direct": stores through that pointer and system-scope GPU atomics for
// every ADD (messages, announces, consumed counts); any other peer gets NVSHMEM puts and signal ops only. Both ends of
// a pair compute the same answer (the domains are symmetric; nvshmem_ptr is non-null both ways on one host). Simulated
// nodes on one host (num_max_nvl_peers=1 on 2 GPUs) thus run the RDMA leg through the same NVSHMEM calls as across
// hosts; the test hook JAX_EP_TEST_ALL_PEERS_REMOTE=1 sets every bit, this rank's too (the only way to run the remote
// path with one GPU).
// NOTE: the host decides (xla_ffi/op_state.cc: remote_ranks has the bits of other domains and of every rank the
// group has no pointer for, peers.base[q] being host nvshmem_ptr's answer), so the kernels read one bit instead of
// NVSHMEM's device state per call, and reach a direct rank's copy of a symmetric address through peers.base
// (direct_ptr: the same address nvshmem_ptr gives).
__device__ __forceinline__ bool is_direct(const Ctx& c, int d) { return !c.remote_ranks.test(d); }

// Rank d's copy of the symmetric address `sym` of this rank's buffer, as this device addresses it (d direct).
template <typename T>
__device__ __forceinline__ T* direct_ptr(const Ctx& c, int d, T* sym) {
  return reinterpret_cast<T*>(peer_base(c.g, d) + (reinterpret_cast<char*>(sym) - self_base(c.g)));
}

// value added to the word at `word_sym` of rank d, by the one mechanism of the pair.
__device__ __forceinline__ void add_to_word(const Ctx& c, uint64_t* word_sym, uint64_t value, int d, bool direct) {
  if (direct)
    atomicAdd_system(reinterpret_cast<unsigned long long*>(direct_ptr(c, d, word_sym)),
                     static_cast<unsigned long long>(value));
  else
    nvshmemx_signal_op(word_sym, value, NVSHMEM_SIGNAL_ADD, c.g.pe[d]);
}

// One counted message from a warp: `bytes` (a multiple of 4) from `src` (global memory this kernel may have
// written: plain loads) to `dst_sym` at `pe`, then +1 on `word_sym` there, after the bytes.
__device__ __forceinline__ void send_counted(const Ctx& c, char* dst_sym, const char* src, int bytes,
                                             uint64_t* word_sym, int d, bool direct) {
  if (!direct) {
    put_counted(dst_sym, src, bytes, word_sym, c.g.pe[d]);
    return;
  }
  copy_segment_from_shared(direct_ptr(c, d, dst_sym), src, bytes);
  __syncwarp();
  if (lane_id() == 0) {
    __threadfence_system();  // the bytes land before their count
    add_to_word(c, word_sym, 1, d, true);
  }
  __syncwarp();
}

// Before op `epoch` writes into peer d's half: d has read the op two epochs back from it.
// NOTE (ordering): acquire loads (system scope) instead of NVSHMEM's signal fetch (volatile) and a system fence:
// d's reset of its half and its reads of op n-2 come before this thread's next accesses, and the caller's
// __syncthreads carries that to every warp of the block before any of them writes at d (the puts are issued after
// it in program order, so a proxy transport's too).
__device__ __forceinline__ void wait_consumed_nvshmem(const Ctx& c, int d, uint32_t epoch) {
  const uint64_t* word = consumed_words(c) + kMaxGroupRanks * (epoch & 1u) + d;
  const uint64_t want = consumed_target(epoch);
  if (ld_acquire_sys_u64(word) >= want) return;
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys_u64(word) < want) {
    if (global_timer_ns() - start > c.g.timeout_ns) {
      if (first_timeout_report())
        printf("jax_ep: timeout after %llu ns in a low-latency send (NVSHMEM) on rank %d: rank %d has not read the "
               "op two epochs back (consumed %llu, want %llu). Trapping.\n",
               static_cast<unsigned long long>(c.g.timeout_ns), c.g.rank, d,
               static_cast<unsigned long long>(ld_acquire_sys_u64(word)), static_cast<unsigned long long>(want));
      __trap();
    }
  }
}

// A dispatch message (header + payload) travels as this many counted messages of at most part_bytes each.
__host__ __device__ __forceinline__ int dispatch_message_parts(bool use_fp8, int hidden, int part_bytes) {
  const int payload_bytes = use_fp8 ? hidden + 4 * (hidden / static_cast<int>(kFp8Block)) : 2 * hidden;
  return (static_cast<int>(kLowLatencyMsgHeader) + payload_bytes + part_bytes - 1) / part_bytes;
}

// Bytes per counted message to a remote rank, for dispatch messages and combine rows alike: 8 KB by default, so a
// message at H=7168 is 2 puts-with-signal bf16 (14 KB) and 1 fp8 (7.2 KB), each from its own warp: K=8 destinations x 2
// parts keep the block's 16 warps busy. NVSHMEM's put over P2P is a copy loop of the calling warp (one 16-byte vector
// per lane per step), so a whole 14 KB message from one warp is a chain of 29 dependent steps while half the warps
// idle; each counted message costs the receiver one signal ADD and the sender one system-scope ordering point on P2P.
// The measurements behind 8 KB: docs/log/2026-11-benchmark-runs.md. JAX_EP_LOW_LATENCY_PUT_BYTES overrides
// it (a multiple of kSegBytes up to 64 KB); jax_ep.initialize validates the variable and checks that every process of
// the job has the same value (the dispatch receivers divide their counts by the parts, so ranks that differ would wait
// forever; the combine's receivers only wait for complete words). Read once per process, for the send and the receive
// kernels alike; an invalid value here (initialize not called) is the default.
constexpr int kDefaultPutPartBytes = 8192;

int put_part_bytes() {
  static const int value = [] {
    const char* v = std::getenv("JAX_EP_LOW_LATENCY_PUT_BYTES");
    const int n = v != nullptr ? std::atoi(v) : 0;
    return n >= kSegBytes && n <= 65536 && n % kSegBytes == 0 ? n : kDefaultPutPartBytes;
  }();
  return value;
}

// The receivers' Wait policy (low_latency_recv.cuh): counted signals instead of epoch flags. parts: counted messages per
// dispatch row (dispatch_message_parts; 1 for the combine, which only waits for completion).
struct NvshmemWait {
  int parts;
  __device__ __forceinline__ int32_t source_count(const Ctx& c, const char*, uint32_t epoch, int l, int s) const {
    const int i = l * c.g.num_ranks + s;
    const uint64_t word = wait_signal(signal_words(c, epoch) + i, c, "low-latency dispatch receive (NVSHMEM)", i);
    phase_stamp(g_low_latency_phases, kPhaseRecvWaited);
    return static_cast<int32_t>(announced(word) / static_cast<uint32_t>(parts));
  }
  __device__ __forceinline__ void expert_rows(const Ctx& c, char*, uint32_t epoch, int e) const {
    wait_signal(signal_words(c, epoch) + e, c, "low-latency combine receive (NVSHMEM)", e);
    phase_stamp(g_low_latency_phases, kPhaseRecvWaited);
  }
};

// The frame of both receive kernels: open, body, and at the end, in the last block to finish (all its threads):
// every counted signal of the half is complete (each sender announces to every rank, so no late announce can land
// after the reset), the words go back to 0 for op n+2, then thread 0 adds 1 to this rank's consumed counter of
// this parity at every rank (its own too: a local atomic, done when the kernel is) and ends the receive (end_recv:
// in_flight_device, state).
// NOTE: the E words are spread over the block's threads: one thread polling E words serially (a volatile load and
// a system fence each) cost ~280 us per op at E=288.
template <typename Params, typename Body>
__device__ __forceinline__ void nvshmem_receive_frame(const Params& p, Body body) {
  const Ctx& c = p.c;
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  phase_begin(g_low_latency_phases);
  if (threadIdx.x == 0) open_recv(p.io, &s_gate);
  __syncthreads();
  if (s_gate.work) body(s_gate.epoch);  // block-uniform
  phase_stamp(g_low_latency_phases, kPhaseRecvBody);
  if (!last_block<TicketScope::kSystem>(low_latency_word(c.g, SignalHeader::kLowLatencyRecvDone), &s_last)) return;
  phase_stamp(g_low_latency_phases, kPhaseRecvLast);
  if (s_gate.work) {
    uint64_t* words = signal_words(c, s_gate.epoch);
    for (int i = threadIdx.x; i < c.num_experts; i += blockDim.x) {
      wait_signal_relaxed(words + i, c, "low-latency receive (NVSHMEM, the last announcements)", i);
      words[i] = 0;
    }
    __syncthreads();
    phase_stamp(g_low_latency_phases, kPhaseRecvReset);
    // One thread per rank (thread 0 adding them one by one cost ~2.7 us at R=2): each fences at system scope first,
    // so every reset of the block (ordered before it by the __syncthreads) is visible before any sender sees its
    // count.
    for (int d = threadIdx.x; d < c.g.num_ranks; d += blockDim.x) {
      __threadfence_system();
      add_to_word(c, consumed_words(c) + kMaxGroupRanks * (s_gate.epoch & 1u) + c.g.rank, 1, d, is_direct(c, d));
    }
    phase_stamp(g_low_latency_phases, kPhaseRecvConsumed);  // thread 0's add done
  }
  if (threadIdx.x == 0) end_recv(c.g, p.io, s_gate);
}

// ---- dispatch send: block per token; the message is built once in the token's send slot, then put to each of
// its distinct experts' owners in parts of put_part_bytes (at H=7168 by default 2 parts bf16, 1 fp8; one counted
// message each, spread over the block's warps). Counts per expert in this rank's scratch; the last block announces
// them all (rows x parts). ----------------------------------------------------------------------------------------
__device__ __forceinline__ void dispatch_send_body(const DispatchSendParams& p, uint32_t epoch, int part_bytes) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, E = c.num_experts, H = c.hidden, K = p.num_topk;
  const int T = p.num_tokens, Tm = c.max_tokens, warp = warp_id(), nw = num_warps();
  char* self = self_base(g);
  const int64_t half = half_offset(c.low_latency, epoch);
  uint32_t* counts = reinterpret_cast<uint32_t*>(self + c.low_latency.scratch);  // [E], zero between kernels
  uint64_t* signals = signal_words(c, epoch);
  __shared__ int32_t s_dest[kMaxTopk];
  __shared__ int32_t s_pos[kMaxTopk];
  __shared__ int32_t s_part[kSendThreads / 32][kMaxTopk];
  __shared__ __align__(16) float s_scales[kSendThreads / 32][kSegChannels / kFp8Block];
  __shared__ int32_t s_direct[kMaxGroupRanks];
  // The consumed wait (peer d has read op n-2, the last op in this half, from this rank's writes there; ~3.7 us at
  // T=1 on 2x H100 when every block did it first) gates what this block writes at the peers (its puts and, in the
  // last block, the announces) and, for some peers, the staging into this rank's own send slots too:
  //   a peer NVSHMEM reaches by load/store (device nvshmem_ptr non-null; every peer on one host, simulated nodes
  //     included): op n-2's puts to it were copies by the issuing warps, finished reading the slots when that kernel
  //     ended, so only the puts wait for it. The last warp waits while the others stage the block's first token (a
  //     row of fewer segments than the block has warps, H < 16384, leaves it no staging of its own), and the staging
  //     __syncthreads orders the wait (and s_direct) before every put;
  //   a peer reached through a proxy or NIC (another host): op n-2's non-blocking puts from this half's slots (a
  //     dispatch's messages or a combine's staged rows) are known to have been read only once that peer counted
  //     op n-2 consumed (its signal arrives after the data), and no quiet ran since. So warp 0 waits for these
  //     before token_slots' first __syncthreads, which orders it before any staging (never stage before it).
  // A block without a token waits after the loop: it may be the last block, whose announces last_block (system
  // scope) orders after every block's wait.
  if (warp == 0 && static_cast<int>(blockIdx.x) < T)
    for (int d = lane_id(); d < R; d += 32)
      if (g_test_all_peers_remote || nvshmem_ptr(self, g.pe[d]) == nullptr) wait_consumed_nvshmem(c, d, epoch);
  const bool waiter = warp == nw - 1;
  auto wait_peers = [&] {
    for (int d = lane_id(); d < R; d += 32) {
      s_direct[d] = is_direct(c, d);
      wait_consumed_nvshmem(c, d, epoch);
    }
    phase_stamp_lane0(g_low_latency_phases, kPhaseSendConsumed);
  };
  const int payload_bytes = p.use_fp8 ? H + 4 * (H / kFp8Block) : 2 * H;
  const int msg_bytes = static_cast<int>(kLowLatencyMsgHeader) + payload_bytes;
  const int nseg_in = (H + kSegChannels - 1) / kSegChannels;
  const int nseg_out = (payload_bytes + kSegBytes - 1) / kSegBytes;
  const int parts = dispatch_message_parts(p.use_fp8, H, part_bytes);
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    token_slots(p.topk_idx, t, K, E, 1, s_dest, s_pos, s_part);
    if (threadIdx.x < K && s_dest[threadIdx.x] >= 0) atomicAdd(counts + s_dest[threadIdx.x], 1u);
    if (waiter && t == static_cast<int>(blockIdx.x)) wait_peers();
    char* slot = self + half + c.low_latency.send + static_cast<int64_t>(t) * c.low_latency.msg_stride;
    const __nv_bfloat16* row = reinterpret_cast<const __nv_bfloat16*>(p.x) + static_cast<int64_t>(t) * H;
    if (p.use_fp8) {
      for (int seg = warp; seg < nseg_in; seg += nw)
        quantize_segment(slot + kLowLatencyMsgHeader, row, H, seg * kSegChannels, min(H, (seg + 1) * kSegChannels),
                         s_scales[warp]);
    } else {
      for (int seg = warp; seg < nseg_out; seg += nw)
        copy_segment_nc(slot + kLowLatencyMsgHeader + seg * kSegBytes,
                        reinterpret_cast<const char*>(row) + seg * kSegBytes,
                        min(kSegBytes, payload_bytes - seg * kSegBytes));
    }
    if (threadIdx.x == 0) *reinterpret_cast<int4*>(slot) = make_int4(t, 0, 0, 0);
    __threadfence();
    __syncthreads();  // the whole message is in the slot before any warp puts it
    if (t == static_cast<int>(blockIdx.x)) phase_stamp(g_low_latency_phases, kPhaseSendStaged);
    for (int item = warp; item < K * parts; item += nw) {
      const int k = item / parts, off = (item % parts) * part_bytes;
      const int dest = s_dest[k];
      if (dest < 0) continue;
      const int l = dest % L, d = dest / L;
      char* dst = self + half + c.low_latency.rows + (static_cast<int64_t>(l * R + me) * Tm + s_pos[k]) * c.low_latency.msg_stride;
      send_counted(c, dst + off, slot + off, min(part_bytes, msg_bytes - off), signals + l * R + me, d,
                   s_direct[d]);
    }
    __syncthreads();  // s_dest / s_pos are reused by the next token
    if (t == static_cast<int>(blockIdx.x)) phase_stamp(g_low_latency_phases, kPhaseSendPut);
  }
  if (waiter && static_cast<int>(blockIdx.x) >= T) wait_peers();
}

__global__ void __launch_bounds__(kSendThreads) nvshmem_dispatch_send_kernel(const __grid_constant__ DispatchSendParams p,
                                                                           int part_bytes) {
  __shared__ Gate s_gate;
  __shared__ int32_t s_last;
  const Ctx& c = p.c;
  phase_begin(g_low_latency_phases);
  if (threadIdx.x == 0)
    open_send(c.g, p.io, p.fused, p.num_tokens,
              p.fused ? "low-latency dispatch (NVSHMEM)" : "low-latency dispatch send (NVSHMEM)", &s_gate,
              consumed_words(c));
  __syncthreads();
  if (s_gate.work) dispatch_send_body(p, s_gate.epoch, part_bytes);  // block-uniform
  if (!last_block<TicketScope::kSystem>(low_latency_word(c.g, SignalHeader::kLowLatencySendDone), &s_last)) return;
  phase_stamp(g_low_latency_phases, kPhaseSendLast);
  if (s_gate.work) {  // every expert's count, 0 included, to its owner (threads in parallel), counters reset
    uint32_t* counts = reinterpret_cast<uint32_t*>(self_base(c.g) + c.low_latency.scratch);
    uint64_t* signals = signal_words(c, s_gate.epoch);
    const int R = c.g.num_ranks, L = c.num_local;
    const uint32_t parts = static_cast<uint32_t>(dispatch_message_parts(p.use_fp8, c.hidden, part_bytes));
    for (int dest = threadIdx.x; dest < c.num_experts; dest += blockDim.x) {
      const uint32_t n = atomicExch(counts + dest, 0u);
      const int d = dest / L;
      add_to_word(c, signals + (dest % L) * R + c.g.rank, announce_value(n * parts), d, is_direct(c, d));
    }
  }
  __syncthreads();
  phase_stamp(g_low_latency_phases, kPhaseSendAnnounced);
  if (threadIdx.x == 0) finish_send_last(c.g, p.io, s_gate);
}

// ---- combine send: blocks (local expert l, part); block `part` takes rows part, part + parts, ... of expert l (whole
// rows, so the block that stages a row also puts it), in two block-wide passes:
//   1. every warp copies 2 KB segments of the block's valid rows: to a direct rank (is_direct: same NVLink domain,
//      load/store mapping; the issue's "NVLink peers keep the direct-pointer path") straight into its slot
//      [global expert][token] through direct_ptr, to the others into this rank's send slots (a remote transport's
//      source must be symmetric or registered memory);
//   2. after one __syncthreads: per direct rank, one system fence and ONE add of the segments this block stored
//      there; to the other ranks, each staged row in parts (whole segments, at most put_part_bytes: as many as keep
//      the warps busy, see nparts), one counted put-with-signal each, spread over the warps.
// Part 0 announces, per source rank, its valid rows x (segments per row if direct, else parts per row).
// NOTE: the first version staged and put every 2 KB segment by itself: a GPU fence, NVSHMEM's fence and a signal
// per segment (7 per row at H=7168), 1.41x the NVLink kernels' combine at T=128 on 2x H100; before that, one warp
// per 14 KB row left a put latency-bound (39 us at T=128 on one H100). ------------------------------------------
__device__ __forceinline__ void combine_send_body(const CombineSendParams& p, uint32_t epoch, int part_bytes) {
  const Ctx& c = p.c;
  const GroupCtx& g = c.g;
  const int R = g.num_ranks, me = g.rank, L = c.num_local, H = c.hidden, Tm = c.max_tokens;
  const int rows_per_expert = R * Tm, row_bytes = 2 * H;
  const int l = blockIdx.x, part = blockIdx.y, parts = gridDim.y, tid = threadIdx.x, warp = warp_id(), nw = num_warps();
  char* self = self_base(g);
  const int64_t half = half_offset(c.low_latency, epoch);
  uint64_t* signal = signal_words(c, epoch) + me * L + l;  // expert e = me * L + l, at every source rank
  const int32_t* src = p.src_info + static_cast<int64_t>(l) * rows_per_expert;
  __shared__ int32_t s_off[kMaxGroupRanks + 1];
  __shared__ int32_t s_direct[kMaxGroupRanks];
  __shared__ uint32_t s_direct_segs[kMaxGroupRanks];  // segments this block stored at each direct rank
  if (tid == 0) source_offsets(s_off, p.layout_range + l * R, R, Tm);
  if (tid < R) {
    s_direct[tid] = is_direct(c, tid);
    s_direct_segs[tid] = 0u;
    wait_consumed_nvshmem(c, tid, epoch);
  }
  __syncthreads();
  const int total = s_off[R];
  const int nseg = (row_bytes + kSegBytes - 1) / kSegBytes;
  // Puts per row to a remote rank: enough that the expert's warps (parts blocks x nw) have about one each, in whole
  // segments, at most part_bytes each: at T=1 (one row) 2 KB parts on 7 warps, at T=128 (~7 rows per expert at
  // EP2) 6 KB, from ~16 rows on 8 KB. Every block of the expert computes the same from `total`.
  const int puts_wanted = max(1, (parts * nw + max(total, 1) - 1) / max(total, 1));
  const int segs_per_put = min(max(1, part_bytes / kSegBytes), max(1, (nseg + puts_wanted - 1) / puts_wanted));
  const int nparts = (nseg + segs_per_put - 1) / segs_per_put, put_bytes = segs_per_put * kSegBytes;
  if (part == 0 && tid < R) {  // a corrupted handle's rows (token out of range) are neither sent nor counted
    uint32_t n = 0;
    for (int i = s_off[tid]; i < s_off[tid + 1]; ++i) {
      const int32_t t = __ldg(src + i);
      n += (t >= 0 && t < Tm) ? 1u : 0u;
    }
    add_to_word(c, signal, announce_value(n * static_cast<uint32_t>(s_direct[tid] ? nseg : nparts)), tid,
                s_direct[tid]);
  }
  const char* rows = static_cast<const char*>(p.expert_out) + static_cast<int64_t>(l) * rows_per_expert * row_bytes;
  char* stage = self + half + c.low_latency.send + static_cast<int64_t>(l) * rows_per_expert * row_bytes;
  const int my_rows = total > part ? (total - part + parts - 1) / parts : 0;
  auto slot_at = [&](int32_t t) {
    return self + half + c.low_latency.rows + (static_cast<int64_t>(me * L + l) * Tm + t) * row_bytes;
  };
  // 1. copies (warp-uniform skips: one item per warp)
  for (int item = warp; item < my_rows * nseg; item += nw) {
    const int i = part + (item / nseg) * parts, off = (item % nseg) * kSegBytes;
    const int bytes = min(kSegBytes, row_bytes - off);
    const int32_t t = __ldg(src + i);
    if (t < 0 || t >= Tm) continue;
    const int s = source_of_row(s_off, R, i);
    const char* from = rows + static_cast<int64_t>(i) * row_bytes + off;
    if (s_direct[s]) {  // read-only source: ld.nc
      copy_segment_nc(direct_ptr(c, s, slot_at(t) + off), from, bytes);
      if (lane_id() == 0) atomicAdd(&s_direct_segs[s], 1u);
    } else {
      copy_segment_nc(stage + static_cast<int64_t>(i) * row_bytes + off, from, bytes);
    }
  }
  __threadfence();  // the staged rows are complete before any warp's put reads them
  __syncthreads();
  // 2a. direct ranks: this block's stores land before their count (fence cumulativity over the __syncthreads)
  if (tid < R && s_direct_segs[tid] != 0u) {
    __threadfence_system();
    add_to_word(c, signal, s_direct_segs[tid], tid, true);
  }
  // 2b. the other ranks: counted puts from the staged rows
  for (int item = warp; item < my_rows * nparts; item += nw) {
    const int i = part + (item / nparts) * parts, off = (item % nparts) * put_bytes;
    const int32_t t = __ldg(src + i);
    if (t < 0 || t >= Tm) continue;
    const int s = source_of_row(s_off, R, i);
    if (s_direct[s]) continue;
    put_counted(slot_at(t) + off, stage + static_cast<int64_t>(i) * row_bytes + off, min(put_bytes, row_bytes - off),
                signal, g.pe[s]);
  }
}

__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    nvshmem_combine_send_kernel(const __grid_constant__ CombineSendParams p, int part_bytes) {
  __shared__ Gate s_gate;
  if (threadIdx.x == 0)
    open_send(p.c.g, p.io, p.fused, 0, p.fused ? "low-latency combine (NVSHMEM)" : "low-latency combine send (NVSHMEM)",
              &s_gate, consumed_words(p.c));
  __syncthreads();
  if (s_gate.work) combine_send_body(p, s_gate.epoch, part_bytes);  // block-uniform
  finish_send(p.c.g, p.io, s_gate);
}

// ---- receives: the NVLink kernels' bodies with counted signals, and the NVSHMEM consumed counters. -------------
__global__ void __launch_bounds__(kThreads, kExpertBlocksPerSm)
    nvshmem_dispatch_recv_kernel(const __grid_constant__ DispatchRecvParams p, int part_bytes) {
  const NvshmemWait wait{dispatch_message_parts(p.use_fp8, p.c.hidden, part_bytes)};
  nvshmem_receive_frame(p, [&](uint32_t epoch) { dispatch_recv_body(p, epoch, wait, BlockPlace::of_grid()); });
}

__global__ void __launch_bounds__(kCombineRecvThreads) nvshmem_combine_recv_kernel(const __grid_constant__ CombineRecvParams p) {
  nvshmem_receive_frame(p, [&](uint32_t epoch) {
    combine_recv_body(p, epoch, NvshmemWait{1}, BlockPlace::of_grid());
  });
}

// ---- launchers (the LowLatencyNvshmemOps entries) ------------------------------------------------------------------
// The test hook JAX_EP_TEST_ALL_PEERS_REMOTE=1 (is_direct; and g_test_all_peers_remote, the dispatch send's wait
// before staging), read once per process for all four kernels: a consumed word is written by both receive kernels,
// so they must never disagree on its mechanism.
bool all_peers_remote() {
  static const bool value = [] {
    const char* v = std::getenv("JAX_EP_TEST_ALL_PEERS_REMOTE");
    return v != nullptr && std::string(v) == "1";
  }();
  return value;
}

// The params with every rank remote under the test hook.
template <typename Params>
Params with_test_hook(const Params& p) {
  Params q = p;
  if (all_peers_remote()) q.c.remote_ranks = RankMask::all();
  return q;
}

const char* refuse_per_rank(bool per_rank) {
  return per_rank ? "low_latency_mode='per_rank' has no NVSHMEM kernels yet (they run when "
                    "allow_nvlink_for_low_latency=False or R > num_max_nvl_peers; use low_latency_mode='per_expert')"
                  : nullptr;
}

const char* dispatch_send(const DispatchSendParams& p, cudaStream_t stream) {
  if (const char* e = refuse_per_rank(p.per_rank)) return e;
  nvshmem_dispatch_send_kernel<<<send_grid(p), kSendThreads, 0, stream>>>(with_test_hook(p), put_part_bytes());
  return launch_error("low-latency dispatch send (NVSHMEM)");
}

const char* dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream) {
  if (const char* e = refuse_per_rank(p.per_rank)) return e;
  nvshmem_dispatch_recv_kernel<<<expert_grid(p.c), kThreads, 0, stream>>>(with_test_hook(p), put_part_bytes());
  return launch_error("low-latency dispatch receive (NVSHMEM)");
}

const char* combine_send(const CombineSendParams& p, cudaStream_t stream) {
  if (const char* e = refuse_per_rank(p.per_rank)) return e;
  nvshmem_combine_send_kernel<<<expert_grid(p.c), kThreads, 0, stream>>>(with_test_hook(p), put_part_bytes());
  return launch_error("low-latency combine send (NVSHMEM)");
}

const char* combine_recv(const CombineRecvParams& p, cudaStream_t stream) {
  if (const char* e = refuse_per_rank(p.per_rank)) return e;
  const dim3 grid = combine_recv_grid(p, kCombineRecvThreads);
  nvshmem_combine_recv_kernel<<<grid, kCombineRecvThreads, 0, stream>>>(with_test_hook(p));
  return launch_error("low-latency combine receive (NVSHMEM)");
}

}  // namespace

Status preload_kernels() {
  JAX_EP_RETURN_IF_ERROR(preload({reinterpret_cast<const void*>(nvshmem_dispatch_send_kernel),
                                  reinterpret_cast<const void*>(nvshmem_dispatch_recv_kernel),
                                  reinterpret_cast<const void*>(nvshmem_combine_send_kernel),
                                  reinterpret_cast<const void*>(nvshmem_combine_recv_kernel)}));
  const char* v = std::getenv("JAX_EP_TEST_COUNT_REMOTE_BYTES");
  const uint32_t on = v != nullptr && std::string(v) == "1" ? 1u : 0u;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(g_count_remote_bytes, &on, sizeof(on)));
  const uint32_t all_remote = all_peers_remote() ? 1u : 0u;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(g_test_all_peers_remote, &all_remote, sizeof(all_remote)));
  JAX_EP_RETURN_IF_ERROR(phase_sums_arm(g_low_latency_phases));
  return Status::Ok();
}

Status low_latency_phases(bool reset, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits) {
  ns->clear();
  hits->clear();
  JAX_EP_RETURN_IF_ERROR(phase_sums_read(g_low_latency_phases, reset, ns, hits));
  ns->resize(kLowLatencyPhases);
  hits->resize(kLowLatencyPhases);
  return Status::Ok();
}

const char* const* low_latency_phase_names() {
  static const char* const names[] = {
      "send: consumed waited", "send: first token staged", "send: first token put", "send: last block reached",
      "send: counts announced", "recv: first word complete", "recv: body done", "recv: last block reached",
      "recv: signal words reset", "recv: consumed counts added"};
  static_assert(sizeof(names) / sizeof(names[0]) == kLowLatencyPhases, "one name per LowLatencyPhase");
  return names;
}

Status remote_put_bytes(bool reset, uint64_t* out) {
  unsigned long long bytes = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaMemcpyFromSymbol(&bytes, g_remote_bytes, sizeof(bytes)));
  if (reset) {
    const unsigned long long zero = 0;
    JAX_EP_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(g_remote_bytes, &zero, sizeof(zero)));
  }
  *out = bytes;
  return Status::Ok();
}

namespace {

const LowLatencyNvshmemOps kOps = {kLowLatencyNvshmemAbi, &dispatch_send, &dispatch_recv, &combine_send, &combine_recv};

}  // namespace

const LowLatencyNvshmemOps* low_latency_ops() { return &kOps; }

}  // namespace jax_ep::nvshmem
