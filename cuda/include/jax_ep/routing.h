// Routing rules shared by the host (CPU handler) and device code, so both read the spec the same way.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_EP_HD __host__ __device__ __forceinline__
#else
#define JAX_EP_HD inline
#endif

namespace jax_ep {

// SPEC §3: topk ids are in [-1, E); any other value is treated as -1 ("no expert").
JAX_EP_HD bool valid_expert(int32_t e, int32_t num_experts) { return e >= 0 && e < num_experts; }

// Rank owning expert e (experts are split in contiguous blocks of E/R); -1 for an invalid id.
JAX_EP_HD int32_t rank_of_expert(int32_t e, int32_t num_experts, int32_t experts_per_rank) {
  return valid_expert(e, num_experts) ? e / experts_per_rank : -1;
}

// True when topk_idx[k] names an expert already named by an earlier k of the same token: a token counts once per
// expert (docs/API.md), so repeats are skipped when counting.
JAX_EP_HD bool repeats_earlier(const int32_t* row, int k) {
  for (int j = 0; j < k; ++j)
    if (row[j] == row[k]) return true;
  return false;
}

}  // namespace jax_ep
