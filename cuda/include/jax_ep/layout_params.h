// Routing (SPEC §3): the rules for reading topk ids, shared by host and device code, and the parameters of the
// layout computation (FFI target jax_ep_layout_v1; also run inside the normal-mode dispatch).
#pragma once

#include <cstdint>

#include "jax_ep/macros.h"

namespace jax_ep::layout {

// SPEC §3: topk ids are in [-1, E); any other value is treated as -1 ("no expert").
JAX_EP_HD bool valid_expert(int32_t e, int32_t num_experts) { return e >= 0 && e < num_experts; }

// Rank owning expert e (experts are split in contiguous blocks of E/R); -1 for an invalid id.
JAX_EP_HD int32_t rank_of_expert(int32_t e, int32_t num_experts, int32_t experts_per_rank) {
  return valid_expert(e, num_experts) ? e / experts_per_rank : -1;
}

// True when row[k] names an expert already named by an earlier k of the same token: a token counts once per
// expert (docs/API.md), so repeats are skipped when counting.
JAX_EP_HD bool repeats_earlier(const int32_t* row, int k) {
  for (int j = 0; j < k; ++j)
    if (row[j] == row[k]) return true;
  return false;
}

// Layout of one rank's tokens. T may be 0.
struct Params {
  const int32_t* topk_idx;          // [T, K] s32, values in [-1, E); others treated as -1
  int32_t* num_tokens_per_rank;     // [R] s32 out
  int32_t* num_tokens_per_expert;   // [E] s32 out
  bool* is_token_in_rank;           // [T, R] pred out, optional (nullptr)
  int32_t* send_pos;                // [T, R] s32 out, optional (nullptr): rank of t among tokens sent to r, else -1
  int32_t num_tokens;               // T
  int32_t num_topk;                 // K
  int32_t num_experts;              // E
  int32_t num_ranks;                // R (E % R == 0)
};

}  // namespace jax_ep::layout
