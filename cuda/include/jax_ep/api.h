// The cuda/ layer's entry points, one namespace per mode (as DeepEP's csrc/kernels/api.cuh). Plain C++ (no XLA, no
// Python): each takes one Params struct (+ a stream) and returns a Status; nothing here allocates, synchronizes with
// the host, or exits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "jax_ep/group_ctx.h"
#include "jax_ep/low_latency_params.h"
#include "jax_ep/normal_params.h"
#include "jax_ep/layout_params.h"
#include "jax_ep/status.h"

namespace jax_ep::layout {

// Host loop (the CPU handler). Same semantics as launch, bit for bit.
Status run_host(const Params& p);

// One block; T, E, R validated by the caller against constants.h.
Status launch(const Params& p, cudaStream_t stream);

// Loads the kernels into the current device's context (CUDA lazy loading would load each at its first launch).
Status preload_kernels();

}  // namespace jax_ep::layout

namespace jax_ep::normal {

// Each op begins with a group rendezvous (so staging reuse across consecutive calls is safe): a barrier, or in
// dispatch the count exchange, which implies one. Only device-side counters (CUDA-graph replay safe). Launches
// several kernels on `stream`; no host synchronization.
Status launch_dispatch(const DispatchParams& p, cudaStream_t stream);
Status launch_cached_dispatch(const CachedDispatchParams& p, cudaStream_t stream);
Status launch_combine(const CombineParams& p, cudaStream_t stream);

// One barrier on this device's side of the group (the group warm-up of the transport).
Status launch_group_barrier(const GroupCtx& g, cudaStream_t stream);

// Loads the kernels into the current device's context and arms their phase stamps there when JAX_EP_TEST_PHASES=1.
Status preload_kernels();

// Test hook JAX_EP_TEST_PHASES=1 (common/phase_stamps.cuh): per phase of these kernels, its name, the summed ns from a
// block's start and the number of stamps, over every device armed in this process since the last reset; synchronizes
// those devices first.
Status phases(bool reset, std::vector<std::string>* names, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits);

}  // namespace jax_ep::normal

namespace jax_ep::low_latency {

// No barrier, no host synchronization. Split ops: one kernel each. Fused ops (launch_dispatch / launch_combine): one
// kernel playing both halves (the send's io serves it) for the combine of both modes and a per_expert dispatch of one
// token; otherwise the send kernel then the receive kernel on the same stream, joined by the header's fused-token
// slot (the ChainIO of each Params says where).
Status launch_dispatch_send(const DispatchSendParams& p, cudaStream_t stream);
Status launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream);
Status launch_dispatch(const DispatchSendParams& send, const DispatchRecvParams& recv, cudaStream_t stream);
Status launch_combine_send(const CombineSendParams& p, cudaStream_t stream);
Status launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream);
Status launch_combine(const CombineSendParams& send, const CombineRecvParams& recv, cudaStream_t stream);

// Loads the kernels into the current device's context and arms their phase stamps there when JAX_EP_TEST_PHASES=1.
Status preload_kernels();

// Test hook JAX_EP_TEST_PHASES=1: as normal::phases, for the NVLink low-latency kernels (low_latency_phases.cuh).
Status phases(bool reset, std::vector<std::string>* names, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits);

}  // namespace jax_ep::low_latency
