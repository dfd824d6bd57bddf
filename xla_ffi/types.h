// Buffer type aliases for handler signatures and bindings (no commas: the XLA_FFI_DEFINE_* macros split on them).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_types {

namespace ffi = ::xla::ffi;

using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vec = ffi::Buffer<ffi::S32, 1>;
using S32Mat = ffi::Buffer<ffi::S32, 2>;
using S32Cube = ffi::Buffer<ffi::S32, 3>;
using F32Mat = ffi::Buffer<ffi::F32, 2>;
using F32Cube = ffi::Buffer<ffi::F32, 3>;
using PredMat = ffi::Buffer<ffi::PRED, 2>;
using AnyBuf = ffi::AnyBuffer;

}  // namespace jax_ep::ffi_types
