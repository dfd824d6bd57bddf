# Finds the XLA FFI headers shipped inside the jaxlib wheel (jax.ffi.include_dir()).
#
# Build against the jaxlib that will run the extension, or an older one: a handler records the FFI API version of
# the headers it was compiled with and XLA refuses handlers newer than itself (docs/BUILDING.md).
#
# Input:  Python_EXECUTABLE (found by the caller), optional JAX_EP_XLA_FFI_INCLUDE_DIR to override.
# Output: JAX_EP_XLA_FFI_FOUND, JAX_EP_XLA_FFI_INCLUDE_DIR, JAX_EP_XLA_FFI_VERSION ("major.minor"),
#         JAX_EP_XLA_FFI_REASON (why not found), imported target jax_ep::xla_ffi_headers.

set(JAX_EP_XLA_FFI_FOUND FALSE)
set(JAX_EP_XLA_FFI_REASON "")

if(NOT JAX_EP_XLA_FFI_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import jax; print(jax.ffi.include_dir())"
    OUTPUT_VARIABLE _jax_ep_ffi_dir
    ERROR_VARIABLE _jax_ep_ffi_err
    RESULT_VARIABLE _jax_ep_ffi_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_jax_ep_ffi_rc EQUAL 0 AND EXISTS "${_jax_ep_ffi_dir}/xla/ffi/api/ffi.h")
    set(JAX_EP_XLA_FFI_INCLUDE_DIR "${_jax_ep_ffi_dir}")
  endif()
endif()

if(JAX_EP_XLA_FFI_INCLUDE_DIR AND EXISTS "${JAX_EP_XLA_FFI_INCLUDE_DIR}/xla/ffi/api/c_api.h")
  file(STRINGS "${JAX_EP_XLA_FFI_INCLUDE_DIR}/xla/ffi/api/c_api.h" _jax_ep_ffi_major
       REGEX "^#define XLA_FFI_API_MAJOR [0-9]+")
  file(STRINGS "${JAX_EP_XLA_FFI_INCLUDE_DIR}/xla/ffi/api/c_api.h" _jax_ep_ffi_minor
       REGEX "^#define XLA_FFI_API_MINOR [0-9]+")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _jax_ep_ffi_major "${_jax_ep_ffi_major}")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _jax_ep_ffi_minor "${_jax_ep_ffi_minor}")
  set(JAX_EP_XLA_FFI_VERSION "${_jax_ep_ffi_major}.${_jax_ep_ffi_minor}")
  set(JAX_EP_XLA_FFI_FOUND TRUE)
  if(NOT TARGET jax_ep::xla_ffi_headers)
    add_library(jax_ep::xla_ffi_headers INTERFACE IMPORTED)
    # SYSTEM: the FFI headers are not ours; keep their warnings out of our builds.
    target_include_directories(jax_ep::xla_ffi_headers SYSTEM INTERFACE "${JAX_EP_XLA_FFI_INCLUDE_DIR}")
  endif()
else()
  set(JAX_EP_XLA_FFI_REASON
      "XLA FFI headers not found (python -c 'import jax; jax.ffi.include_dir()' failed: ${_jax_ep_ffi_err})")
endif()
