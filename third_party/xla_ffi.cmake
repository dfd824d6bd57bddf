# Finds the XLA FFI headers shipped inside the jaxlib wheel (site-packages/jaxlib/include, what
# jax.ffi.include_dir() returns), without importing jax or jaxlib: an isolated build has jaxlib (its build
# requirement, pinned to the oldest supported version) but not jax.
#
# Build against the jaxlib that will run the extension, or an older one: a handler records the FFI API version of
# the headers it was compiled with and XLA refuses handlers newer than itself (docs/BUILDING.md).
#
# Input:  Python_EXECUTABLE (found by the caller); optional JAX_EP_XLA_FFI_INCLUDE_DIR (CMake variable or
#         environment variable) to override.
# Output: JAX_EP_XLA_FFI_FOUND, JAX_EP_XLA_FFI_INCLUDE_DIR, JAX_EP_XLA_FFI_VERSION ("major.minor"),
#         JAX_EP_XLA_FFI_JAXLIB_VERSION (the jaxlib the headers came from, "" when overridden),
#         JAX_EP_XLA_FFI_REASON (why not found), imported target jax_ep::xla_ffi_headers.

set(JAX_EP_XLA_FFI_FOUND FALSE)
set(JAX_EP_XLA_FFI_REASON "")
set(JAX_EP_XLA_FFI_JAXLIB_VERSION "")

if(NOT JAX_EP_XLA_FFI_INCLUDE_DIR AND DEFINED ENV{JAX_EP_XLA_FFI_INCLUDE_DIR})
  set(JAX_EP_XLA_FFI_INCLUDE_DIR "$ENV{JAX_EP_XLA_FFI_INCLUDE_DIR}")
endif()

if(JAX_EP_XLA_FFI_INCLUDE_DIR)
  if(NOT EXISTS "${JAX_EP_XLA_FFI_INCLUDE_DIR}/xla/ffi/api/c_api.h")
    set(JAX_EP_XLA_FFI_REASON "JAX_EP_XLA_FFI_INCLUDE_DIR=${JAX_EP_XLA_FFI_INCLUDE_DIR} has no xla/ffi/api/c_api.h")
  endif()
else()
  # find_spec locates the package without running its __init__ (no numpy/scipy import, works in any build env).
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util, importlib.metadata as m, os, sys\n\
s = importlib.util.find_spec('jaxlib')\n\
if s is None or not s.submodule_search_locations: sys.exit('jaxlib is not installed')\n\
print(os.path.join(list(s.submodule_search_locations)[0], 'include'))\n\
try: print(m.version('jaxlib'))\n\
except Exception: print('unknown')"
    OUTPUT_VARIABLE _jax_ep_ffi_out
    ERROR_VARIABLE _jax_ep_ffi_err
    RESULT_VARIABLE _jax_ep_ffi_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_STRIP_TRAILING_WHITESPACE)
  if(_jax_ep_ffi_rc EQUAL 0)
    string(REPLACE "\n" ";" _jax_ep_ffi_out "${_jax_ep_ffi_out}")
    list(GET _jax_ep_ffi_out 0 _jax_ep_ffi_dir)
    list(GET _jax_ep_ffi_out 1 JAX_EP_XLA_FFI_JAXLIB_VERSION)
    if(EXISTS "${_jax_ep_ffi_dir}/xla/ffi/api/c_api.h")
      set(JAX_EP_XLA_FFI_INCLUDE_DIR "${_jax_ep_ffi_dir}")
    else()
      string(CONCAT JAX_EP_XLA_FFI_REASON
          "jaxlib ${JAX_EP_XLA_FFI_JAXLIB_VERSION} has no XLA FFI headers (${_jax_ep_ffi_dir}/xla/ffi/api/c_api.h "
          "missing); jax_ep needs jaxlib >= 0.10.2")
    endif()
  else()
    string(CONCAT JAX_EP_XLA_FFI_REASON
        "jaxlib is not installed for ${Python_EXECUTABLE}, so there are no XLA FFI headers (an isolated build gets "
        "jaxlib from [build-system] requires; with --no-build-isolation install jaxlib first, or set "
        "JAX_EP_XLA_FFI_INCLUDE_DIR)")
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
  set(JAX_EP_XLA_FFI_REASON "")
  if(JAX_EP_XLA_FFI_JAXLIB_VERSION)
    message(STATUS "jax_ep: XLA FFI headers of jaxlib ${JAX_EP_XLA_FFI_JAXLIB_VERSION} (FFI API "
                   "${JAX_EP_XLA_FFI_VERSION}): the extension runs on this jaxlib and newer ones")
  endif()
  if(NOT TARGET jax_ep::xla_ffi_headers)
    add_library(jax_ep::xla_ffi_headers INTERFACE IMPORTED)
    # SYSTEM: the FFI headers are not ours; keep their warnings out of our builds.
    target_include_directories(jax_ep::xla_ffi_headers SYSTEM INTERFACE "${JAX_EP_XLA_FFI_INCLUDE_DIR}")
  endif()
endif()
