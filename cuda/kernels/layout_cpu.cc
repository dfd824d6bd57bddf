// CPU version of the routing layout (SPEC §3). Used by the "cpu" FFI handler and as the executable definition the
// CUDA kernel is tested against.
#include <algorithm>
#include <cstring>
#include <vector>

#include "jax_ep/api.h"
#include "jax_ep/layout_params.h"

namespace jax_ep::layout {

Status run_host(const Params& p) {
  const int T = p.num_tokens, K = p.num_topk, E = p.num_experts, R = p.num_ranks;
  const int L = E / R;
  std::fill(p.num_tokens_per_rank, p.num_tokens_per_rank + R, 0);
  std::fill(p.num_tokens_per_expert, p.num_tokens_per_expert + E, 0);
  std::vector<char> in_rank(R);
  for (int t = 0; t < T; ++t) {
    const int32_t* row = p.topk_idx + static_cast<int64_t>(t) * K;
    std::fill(in_rank.begin(), in_rank.end(), 0);
    for (int k = 0; k < K; ++k) {
      const int32_t r = rank_of_expert(row[k], E, L);
      if (r < 0) continue;
      in_rank[r] = 1;
      if (!repeats_earlier(row, k)) ++p.num_tokens_per_expert[row[k]];
    }
    for (int r = 0; r < R; ++r) {
      const int64_t tr = static_cast<int64_t>(t) * R + r;
      if (p.is_token_in_rank) p.is_token_in_rank[tr] = in_rank[r] != 0;
      if (p.send_pos) p.send_pos[tr] = in_rank[r] ? p.num_tokens_per_rank[r] : -1;
      p.num_tokens_per_rank[r] += in_rank[r];
    }
  }
  return Status::Ok();
}

}  // namespace jax_ep::layout
