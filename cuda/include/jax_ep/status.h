// Error values for the cuda/ layer: no exceptions cross this layer, nothing here exits the process.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

namespace jax_ep {

// Empty message = success. Kept as a plain string so the FFI layer can wrap it into ffi::Error unchanged.
class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string msg) { return Status(std::move(msg)); }
  bool ok() const { return msg_.empty(); }
  const std::string& message() const { return msg_; }

 private:
  explicit Status(std::string msg) : msg_(std::move(msg)) {
    if (msg_.empty()) msg_ = "unknown error";
  }
  std::string msg_;
};

inline Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                       ") from `" + expr + "` at " + file + ":" + std::to_string(line));
}

}  // namespace jax_ep

// Evaluates a CUDA runtime call; on failure returns a Status naming the expression and file:line.
#define JAX_EP_CUDA_RETURN_IF_ERROR(expr)                                            \
  do {                                                                               \
    ::jax_ep::Status _jax_ep_st = ::jax_ep::CudaStatus((expr), #expr, __FILE__, __LINE__); \
    if (!_jax_ep_st.ok()) return _jax_ep_st;                                         \
  } while (0)

#define JAX_EP_RETURN_IF_ERROR(status_expr)            \
  do {                                                 \
    ::jax_ep::Status _jax_ep_st2 = (status_expr);      \
    if (!_jax_ep_st2.ok()) return _jax_ep_st2;         \
  } while (0)
