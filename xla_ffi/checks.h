// Shape / argument checks and device selection shared by the CUDA handlers. Every failed check returns an
// InvalidArgument error that names the target and the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "errors.h"
#include "jax_ep/status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_util {

inline std::string shape_str(::xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline bool dims_are(::xla::ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (dims[i++] != w) return false;
  return true;
}

// Set the calling thread's device to the handler's (kernel launches go to XLA's stream of that device).
inline Status ensure_device(int ordinal) {
  int cur = -1;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&cur));
  if (cur != ordinal) JAX_EP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  return Status::Ok();
}

}  // namespace jax_ep::ffi_util

#define JAX_EP_CHECK_SHAPE(target, name, buf, ...)                                                              \
  do {                                                                                                          \
    if (!::jax_ep::ffi_util::dims_are((buf).dimensions(), {__VA_ARGS__}))                                      \
      return ::jax_ep::ffi_util::Invalid(target, std::string(name) + " has shape " +                            \
                                                     ::jax_ep::ffi_util::shape_str((buf).dimensions()) +        \
                                                     ", expected [" #__VA_ARGS__ "]");                          \
  } while (0)

#define JAX_EP_CHECK(target, cond, msg)                                 \
  do {                                                                  \
    if (!(cond)) return ::jax_ep::ffi_util::Invalid(target, (msg));     \
  } while (0)
