// Thread / warp indices shared by the kernels of every mode.
#pragma once

namespace jax_ep {

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }
__device__ __forceinline__ int num_warps() { return blockDim.x >> 5; }
// Warps of a 1-D grid, numbered across blocks.
__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int num_global_warps() { return (gridDim.x * blockDim.x) >> 5; }

}  // namespace jax_ep
