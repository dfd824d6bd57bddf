// Errors are values at the FFI boundary: handlers return ffi::Error, never throw across it, never exit.
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "jax_ep/status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_util {

namespace ffi = ::xla::ffi;

inline ffi::Error ToFfi(const char* target, const Status& st) {
  if (st.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(target) + ": " + st.message());
}

inline ffi::Error Invalid(const char* target, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

// The call cannot run in this process state (e.g. no runtime bound for the mesh axis).
inline ffi::Error Precondition(const char* target, const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string(target) + ": " + msg);
}

// Runs a handler body; any C++ exception becomes an Internal error naming the target.
template <typename Body>
ffi::Error Guarded(const char* target, Body&& body) noexcept {
  try {
    return std::forward<Body>(body)();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(target) + ": unexpected exception: " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(target) + ": unexpected unknown exception");
  }
}

}  // namespace jax_ep::ffi_util
