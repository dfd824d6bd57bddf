// The source rank of a packed row: rows are grouped by source rank in ascending order, with exclusive prefix offsets
// off[0..R] (off[s] = rows of the sources before s; off[0] = 0). Used by every receive that walks packed rows
// (normal-mode copy-out, the low-latency receives of both modes and both transports).
#pragma once

#include <cstdint>

namespace jax_ep {

// The largest s in [0, R) with off[s] <= i (empty sources, whose offset equals the next one's, are skipped), by
// binary search: ceil(log2 R) reads of off[1..R-1], never off[0] or off[R]. For non-decreasing offsets this is the
// row's source; whatever the offsets hold, the answer is in [0, R).
__device__ __forceinline__ int source_of_row(const int32_t* off, int R, int i) {
  int lo = 0, hi = R - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;  // in [1, hi]
    if (off[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace jax_ep
