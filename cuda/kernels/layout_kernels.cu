// Standalone routing layout kernel (FFI target jax_ep_layout_v1 on CUDA).
#include "common/preload.cuh"
#include "common/layout.cuh"
#include "jax_ep/api.h"

namespace jax_ep::layout {
namespace {

__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(const __grid_constant__ Params p) {
  __shared__ BlockSmem sm;
  extern __shared__ int32_t s_expert[];  // [E]
  block_layout(p, sm, s_expert);
  __syncthreads();
  for (int r = threadIdx.x; r < p.num_ranks; r += blockDim.x) p.num_tokens_per_rank[r] = sm.rank_base[r];
  for (int e = threadIdx.x; e < p.num_experts; e += blockDim.x) p.num_tokens_per_expert[e] = s_expert[e];
}

}  // namespace

Status preload_kernels() { return preload({reinterpret_cast<const void*>(layout_kernel)}); }

Status launch(const Params& p, cudaStream_t stream) {
  const size_t smem = sizeof(int32_t) * static_cast<size_t>(p.num_experts);
  layout_kernel<<<1, kLayoutThreads, smem, stream>>>(p);
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace jax_ep::layout
