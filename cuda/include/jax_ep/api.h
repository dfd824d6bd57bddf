// The cuda/ layer's entry points. Plain C++ (no XLA, no Python): each takes one Params struct (+ a stream) and
// returns a Status; nothing here allocates, synchronizes with the host, or exits.
#pragma once

#include <cuda_runtime_api.h>

#include "jax_ep/low_latency.h"
#include "jax_ep/params.h"
#include "jax_ep/status.h"

namespace jax_ep {

// Host loop (the CPU handler). Same semantics as launch_layout, bit for bit.
Status layout_host(const LayoutParams& p);

// One block; T, E, R validated by the caller against constants.h.
Status launch_layout(const LayoutParams& p, cudaStream_t stream);

}  // namespace jax_ep

namespace jax_ep {

// Intranode ops. Each begins with a group barrier (so staging reuse across consecutive calls is safe) and uses only
// device-side counters (CUDA-graph replay safe). Launches several kernels on `stream`; no host synchronization.
Status launch_dispatch(const DispatchParams& p, cudaStream_t stream);
Status launch_cached_dispatch(const CachedDispatchParams& p, cudaStream_t stream);
Status launch_combine(const CombineParams& p, cudaStream_t stream);

// One barrier on this device's side of the group (group creation warm-up).
Status launch_group_barrier(const GroupCtx& g, cudaStream_t stream);

}  // namespace jax_ep

namespace jax_ep {

// Low-latency ops (cuda/kernels/low_latency.cu). No barrier, no host synchronization; each half is one kernel.
Status launch_low_latency_dispatch_send(const LowLatencyDispatchSendParams& p, cudaStream_t stream);
Status launch_low_latency_dispatch_recv(const LowLatencyDispatchRecvParams& p, cudaStream_t stream);
Status launch_low_latency_combine_send(const LowLatencyCombineSendParams& p, cudaStream_t stream);
Status launch_low_latency_combine_recv(const LowLatencyCombineRecvParams& p, cudaStream_t stream);

}  // namespace jax_ep

namespace jax_ep {

// Load every kernel into the current device's context (CUDA lazy loading would load each at its first launch).
// Called by the group warm-up on each device.
Status preload_layout_kernels();
Status preload_intranode_kernels();
Status preload_low_latency_kernels();

}  // namespace jax_ep
