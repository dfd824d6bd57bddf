// Thread / warp indices shared by the kernels of every mode.
#pragma once

namespace jax_ep {

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }
__device__ __forceinline__ int num_warps() { return blockDim.x >> 5; }
// Warps of a 1-D grid, numbered across blocks.
__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int num_global_warps() { return (gridDim.x * blockDim.x) >> 5; }

// A block's place in the grid of the role it plays: the kernel's own grid (of_grid), or the share of a kernel's
// grid that one role takes when a kernel plays several (the fused low-latency ops: roles by start ticket). Bodies
// that can run in either index blocks and warps through it, never through blockIdx / gridDim.
struct BlockPlace {
  int x, y, nx, ny;  // this block's (x, y) in an nx * ny grid

  static __device__ __forceinline__ BlockPlace of_grid() {
    return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(gridDim.x),
            static_cast<int>(gridDim.y)};
  }
  // Warps of a 1-D place, numbered across its blocks.
  __device__ __forceinline__ int global_warp() const { return (x * static_cast<int>(blockDim.x) + threadIdx.x) >> 5; }
  __device__ __forceinline__ int num_global_warps() const { return (nx * static_cast<int>(blockDim.x)) >> 5; }
};

}  // namespace jax_ep
