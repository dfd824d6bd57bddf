// A set of ranks of one EP group (R <= kMaxGroupRanks): one bit per rank, host and device. Passed by value inside
// the kernels' __grid_constant__ parameters, so a test reads one word of the constant bank.
#pragma once

#include <cstdint>

#include "jax_ep/constants.h"
#include "jax_ep/macros.h"

namespace jax_ep {

struct RankMask {
  static constexpr int kWords = (kMaxGroupRanks + 63) / 64;
  uint64_t words[kWords];

  JAX_EP_HD static RankMask none() {
    RankMask m{};
    for (int i = 0; i < kWords; ++i) m.words[i] = 0;
    return m;
  }
  JAX_EP_HD static RankMask all() {
    RankMask m{};
    for (int i = 0; i < kWords; ++i) m.words[i] = ~uint64_t{0};
    return m;
  }
  JAX_EP_HD bool test(int r) const { return (words[r >> 6] >> (r & 63)) & 1u; }
  JAX_EP_HD void set(int r) { words[r >> 6] |= uint64_t{1} << (r & 63); }
  JAX_EP_HD void clear(int r) { words[r >> 6] &= ~(uint64_t{1} << (r & 63)); }
  JAX_EP_HD bool any() const {
    uint64_t v = 0;
    for (int i = 0; i < kWords; ++i) v |= words[i];
    return v != 0;
  }
  // Ranks in this set and not in `other`.
  JAX_EP_HD RankMask minus(const RankMask& other) const {
    RankMask m{};
    for (int i = 0; i < kWords; ++i) m.words[i] = words[i] & ~other.words[i];
    return m;
  }
  // The lowest rank in the set, -1 when empty (host only: the handlers' checks).
  int first() const {
    for (int i = 0; i < kWords; ++i)
      for (int b = 0; b < 64; ++b)
        if ((words[i] >> b) & 1u) return 64 * i + b;
    return -1;
  }
};

}  // namespace jax_ep
