#include "receive_pools.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "driver_entry.h"
#include "jax_ep/device_restorer.h"

namespace jax_ep::receive_pools {
namespace {

using PointerGetAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
using RetainAllocationHandle = CUresult (*)(CUmemGenericAllocationHandle*, void*);
using ExportToShareableHandle = CUresult (*)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                             unsigned long long);
using ImportFromShareableHandle = CUresult (*)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
using Release = CUresult (*)(CUmemGenericAllocationHandle);
using AddressReserve = CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
using AddressFree = CUresult (*)(CUdeviceptr, size_t);
using Map = CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
using Unmap = CUresult (*)(CUdeviceptr, size_t);
using SetAccess = CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);

// The driver functions this file calls, looked up once; ok() when every one was found.
struct Driver {
  PointerGetAttribute pointer_get_attribute = nullptr;
  RetainAllocationHandle retain = nullptr;
  ExportToShareableHandle export_handle = nullptr;
  ImportFromShareableHandle import_handle = nullptr;
  Release release = nullptr;
  AddressReserve reserve = nullptr;
  AddressFree address_free = nullptr;
  Map map = nullptr;
  Unmap unmap = nullptr;
  SetAccess set_access = nullptr;

  bool ok() const {
    return pointer_get_attribute && retain && export_handle && import_handle && release && reserve && address_free &&
           map && unmap && set_access;
  }
};

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    x.pointer_get_attribute = reinterpret_cast<PointerGetAttribute>(driver_entry("cuPointerGetAttribute"));
    x.retain = reinterpret_cast<RetainAllocationHandle>(driver_entry("cuMemRetainAllocationHandle"));
    x.export_handle = reinterpret_cast<ExportToShareableHandle>(driver_entry("cuMemExportToShareableHandle"));
    x.import_handle = reinterpret_cast<ImportFromShareableHandle>(driver_entry("cuMemImportFromShareableHandle"));
    x.release = reinterpret_cast<Release>(driver_entry("cuMemRelease"));
    x.reserve = reinterpret_cast<AddressReserve>(driver_entry("cuMemAddressReserve"));
    x.address_free = reinterpret_cast<AddressFree>(driver_entry("cuMemAddressFree"));
    x.map = reinterpret_cast<Map>(driver_entry("cuMemMap"));
    x.unmap = reinterpret_cast<Unmap>(driver_entry("cuMemUnmap"));
    x.set_access = reinterpret_cast<SetAccess>(driver_entry("cuMemSetAccess"));
    return x;
  }();
  return d;
}

Status driver_error(const char* call, CUresult r) {
  return Status::Error(std::string(call) + " failed with CUresult " + std::to_string(static_cast<int>(r)));
}

// Imported mappings by (exporter pid, its base, bytes): where this process maps each. Never unmapped.
std::mutex imports_mu;
std::map<std::tuple<int64_t, uintptr_t, int64_t>, uintptr_t>& imports() {
  static std::map<std::tuple<int64_t, uintptr_t, int64_t>, uintptr_t> m;
  return m;
}

// Maps the allocation of fd at a new address range for device `ordinal`; releases what it made on failure.
Status map_for(const Driver& d, int fd, int64_t bytes, int ordinal, uintptr_t* local) {
  CUmemGenericAllocationHandle handle{};
  const void* os_handle = reinterpret_cast<void*>(static_cast<uintptr_t>(fd));
  CUresult r = d.import_handle(&handle, const_cast<void*>(os_handle), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) return driver_error("cuMemImportFromShareableHandle", r);
  const size_t size = static_cast<size_t>(bytes);
  CUdeviceptr va = 0;
  if ((r = d.reserve(&va, size, 0, 0, 0)) != CUDA_SUCCESS) {
    d.release(handle);
    return driver_error("cuMemAddressReserve", r);
  }
  if ((r = d.map(va, size, 0, handle, 0)) != CUDA_SUCCESS) {
    d.address_free(va, size);
    d.release(handle);
    return driver_error("cuMemMap", r);
  }
  d.release(handle);  // the mapping holds the allocation from here on
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((r = d.set_access(va, size, &access, 1)) != CUDA_SUCCESS) {
    d.unmap(va, size);
    d.address_free(va, size);
    return driver_error("cuMemSetAccess", r);
  }
  *local = static_cast<uintptr_t>(va);
  return Status::Ok();
}

}  // namespace

Status export_pool(uintptr_t ptr, Exported* out) {
  const Driver& d = driver();
  if (!d.ok()) return Status::Error("this CUDA driver lacks the virtual-memory functions receive pools need");
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long types = 0;
  const CUdeviceptr p = static_cast<CUdeviceptr>(ptr);
  CUresult r = d.pointer_get_attribute(&base, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, p);
  if (r == CUDA_SUCCESS) r = d.pointer_get_attribute(&size, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, p);
  if (r != CUDA_SUCCESS || size == 0)
    return Status::Error("the buffer is not in a virtual-memory mapping (CUresult " + std::to_string(int(r)) + ")");
  r = d.pointer_get_attribute(&types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, p);
  if (r != CUDA_SUCCESS) return driver_error("cuPointerGetAttribute(ALLOWED_HANDLE_TYPES)", r);
  if ((types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0)
    return Status::Error("the allocation allows no POSIX file descriptor (allowed handle types " +
                         std::to_string(types) + ")");
  CUmemGenericAllocationHandle handle{};
  if ((r = d.retain(&handle, reinterpret_cast<void*>(base))) != CUDA_SUCCESS)
    return driver_error("cuMemRetainAllocationHandle", r);
  int fd = -1;
  r = d.export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  d.release(handle);
  if (r != CUDA_SUCCESS) return driver_error("cuMemExportToShareableHandle", r);
  *out = {fd, static_cast<uintptr_t>(base), static_cast<int64_t>(size)};
  return Status::Ok();
}

Status import_pool(int fd, int64_t pid, uintptr_t base, int64_t bytes, int ordinal, int64_t probe_offset,
                   const std::string& expect, uintptr_t* local) {
  const Driver& d = driver();
  if (!d.ok()) return Status::Error("this CUDA driver lacks the virtual-memory functions receive pools need");
  if (bytes <= 0 || probe_offset < 0 || probe_offset + static_cast<int64_t>(expect.size()) > bytes)
    return Status::Error("import_pool: the probe lies outside the pool");
  DeviceRestorer restore;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  uintptr_t va = 0;
  {
    std::lock_guard<std::mutex> lock(imports_mu);
    const auto key = std::make_tuple(pid, base, bytes);
    const auto it = imports().find(key);
    if (it != imports().end()) {
      va = it->second;
    } else {
      if (Status st = map_for(d, fd, bytes, ordinal, &va); !st.ok()) return st;
      imports()[key] = va;
    }
  }
  std::vector<char> got(expect.size());
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaMemcpy(got.data(), reinterpret_cast<const void*>(va + probe_offset), got.size(),
                                         cudaMemcpyDeviceToHost));
  if (std::string(got.begin(), got.end()) != expect)
    return Status::Error("the mapped pool of process " + std::to_string(pid) +
                         " does not hold its probe (the mapping does not start at its allocation's first byte)");
  *local = va;
  return Status::Ok();
}

}  // namespace jax_ep::receive_pools
