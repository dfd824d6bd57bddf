# Finds NVSHMEM as shipped by the pip wheel nvidia-nvshmem-cu13 (site-packages/nvidia/nvshmem).
#
# The wheel has no CMake config and no unversioned libnvshmem_host.so, so the imported targets are made by hand.
# Build against the NVSHMEM installed where the extension runs: the first libnvshmem_host.so.3 loaded into a
# process wins, and a device library from a newer NVSHMEM needs host symbols an older one lacks.
#
# An isolated build gets the wheel from [build-system] requires (pinned to the oldest supported NVSHMEM, 3.4.5: a
# module built against older headers runs on a newer libnvshmem_host.so.3, not always the reverse).
#
# Input:  Python_EXECUTABLE, optional JAX_EP_NVSHMEM_ROOT (CMake or environment variable: a directory holding
#         include/ and lib/).
# Output: JAX_EP_NVSHMEM_FOUND (headers found), JAX_EP_NVSHMEM_ROOT, JAX_EP_NVSHMEM_VERSION, JAX_EP_NVSHMEM_REASON,
#         imported targets jax_ep::nvshmem_headers, jax_ep::nvshmem_host (shared), jax_ep::nvshmem_device (static)
#         (the library targets exist only when the files do).
#
# NOTE: nothing in the main extension links these; only the separate, lazily imported jax_ep._jax_ep_nvshmem does.

set(JAX_EP_NVSHMEM_FOUND FALSE)
set(JAX_EP_NVSHMEM_REASON "")
set(_jax_ep_nvshmem_why "")

if(NOT JAX_EP_NVSHMEM_ROOT AND DEFINED ENV{JAX_EP_NVSHMEM_ROOT})
  set(JAX_EP_NVSHMEM_ROOT "$ENV{JAX_EP_NVSHMEM_ROOT}")
endif()
if(NOT JAX_EP_NVSHMEM_ROOT)
  # nvidia/ is a namespace package: take the first entry of nvidia.nvshmem.__path__.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE _jax_ep_nvshmem_dir
    ERROR_QUIET
    RESULT_VARIABLE _jax_ep_nvshmem_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_jax_ep_nvshmem_rc EQUAL 0)
    set(JAX_EP_NVSHMEM_ROOT "${_jax_ep_nvshmem_dir}")
  else()
    string(CONCAT _jax_ep_nvshmem_why
        "the nvidia-nvshmem-cu13 wheel is not installed for ${Python_EXECUTABLE} (an isolated build gets it from "
        "[build-system] requires; with --no-build-isolation pip install nvidia-nvshmem-cu13 first, or set "
        "JAX_EP_NVSHMEM_ROOT)")
  endif()
endif()

if(JAX_EP_NVSHMEM_ROOT AND EXISTS "${JAX_EP_NVSHMEM_ROOT}/include/nvshmem.h")
  set(JAX_EP_NVSHMEM_FOUND TRUE)
  set(_jax_ep_vh "${JAX_EP_NVSHMEM_ROOT}/include/non_abi/nvshmem_version.h")
  if(EXISTS "${_jax_ep_vh}")
    foreach(_part MAJOR MINOR PATCH)
      file(STRINGS "${_jax_ep_vh}" _line REGEX "^#define NVSHMEM_VENDOR_${_part}_VERSION [0-9]+")
      string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _jax_ep_nv_${_part} "${_line}")
    endforeach()
    set(JAX_EP_NVSHMEM_VERSION "${_jax_ep_nv_MAJOR}.${_jax_ep_nv_MINOR}.${_jax_ep_nv_PATCH}")
  else()
    set(JAX_EP_NVSHMEM_VERSION "unknown")
  endif()

  if(NOT TARGET jax_ep::nvshmem_headers)
    add_library(jax_ep::nvshmem_headers INTERFACE IMPORTED)
    target_include_directories(jax_ep::nvshmem_headers SYSTEM INTERFACE "${JAX_EP_NVSHMEM_ROOT}/include")
  endif()
  set(_jax_ep_host "${JAX_EP_NVSHMEM_ROOT}/lib/libnvshmem_host.so.3")
  if(EXISTS "${_jax_ep_host}" AND NOT TARGET jax_ep::nvshmem_host)
    add_library(jax_ep::nvshmem_host SHARED IMPORTED)
    set_target_properties(jax_ep::nvshmem_host PROPERTIES
      IMPORTED_LOCATION "${_jax_ep_host}"
      IMPORTED_SONAME "libnvshmem_host.so.3"
      INTERFACE_LINK_LIBRARIES jax_ep::nvshmem_headers)
  endif()
  set(_jax_ep_dev "${JAX_EP_NVSHMEM_ROOT}/lib/libnvshmem_device.a")
  if(EXISTS "${_jax_ep_dev}" AND NOT TARGET jax_ep::nvshmem_device)
    add_library(jax_ep::nvshmem_device STATIC IMPORTED)
    set_target_properties(jax_ep::nvshmem_device PROPERTIES
      IMPORTED_LOCATION "${_jax_ep_dev}"
      INTERFACE_LINK_LIBRARIES jax_ep::nvshmem_headers)
  endif()
elseif(_jax_ep_nvshmem_why)
  set(JAX_EP_NVSHMEM_REASON "${_jax_ep_nvshmem_why}")
else()
  set(JAX_EP_NVSHMEM_REASON "NVSHMEM headers not found: ${JAX_EP_NVSHMEM_ROOT}/include/nvshmem.h does not exist")
endif()
