// The NVSHMEM low-latency kernels of this module (low_latency.cu), as the table jax_ep._jax_ep_native launches them
// through (jax_ep/nvshmem_ops.h).
#pragma once

#include <cstdint>
#include <vector>

#include "jax_ep/nvshmem_ops.h"
#include "jax_ep/status.h"

namespace jax_ep::nvshmem {

const LowLatencyNvshmemOps* low_latency_ops();

// Loads the four kernels into the current device's context (CUDA lazy loading would otherwise load each at its
// first launch, ~ms, inside the first real call; cuda/common/preload.cuh), and arms the byte counter below when
// JAX_EP_TEST_COUNT_REMOTE_BYTES=1.
Status preload_kernels();

// Test hook: bytes of rows the current device put to remote peers since the last reset (0 unless counting is
// armed); synchronizes the device first.
Status remote_put_bytes(bool reset, uint64_t* out);

// Test hook JAX_EP_TEST_PHASES=1 (phase_stamps.cuh): per phase of the NVSHMEM low-latency kernels, the summed
// nanoseconds from a block's start and the number of stamps since the last reset; synchronizes the device first.
Status low_latency_phases(bool reset, std::vector<uint64_t>* ns, std::vector<uint64_t>* hits);

// The phases' names, in the order of low_latency_phases' vectors (kLowLatencyPhases of them).
const char* const* low_latency_phase_names();

}  // namespace jax_ep::nvshmem
