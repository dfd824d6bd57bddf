// Macros shared by host and device code of the cuda/ layer.
#pragma once

// Functions usable from host code (handlers, the CPU routing loop, the staging plan) and device code (kernels).
#if defined(__CUDACC__)
#define JAX_EP_HD __host__ __device__ __forceinline__
#else
#define JAX_EP_HD inline
#endif
