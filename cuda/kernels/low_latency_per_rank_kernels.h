// Launchers of the low-latency per_rank kernels (low_latency_per_rank_kernels.cu); low_latency_kernels.cu's launchers call them when a
// params struct says per_rank (the dispatch send is one template for both modes: low_latency_send.cuh). Same parameter
// structs as per_expert mode (low_latency_params.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "jax_ep/low_latency_params.h"
#include "jax_ep/status.h"

namespace jax_ep::low_latency::per_rank {

Status preload_kernels();
// This translation unit's phase sums (low_latency_phases.cuh) added to ns / hits.
Status add_phases(bool reset, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits);
Status launch_dispatch_recv(const DispatchRecvParams& p, cudaStream_t stream);
Status launch_combine_send(const CombineSendParams& p, cudaStream_t stream);  // weight push + partial sums
Status launch_combine_recv(const CombineRecvParams& p, cudaStream_t stream);
Status launch_combine(const CombineSendParams& send, const CombineRecvParams& recv, cudaStream_t stream);  // fused

}  // namespace jax_ep::low_latency::per_rank
