// Host code that switches the calling thread's current CUDA device (group setup, mapping a peer's pool) puts it back
// on scope exit.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_ep {

// Restores the calling thread's current device on scope exit.
class DeviceRestorer {
 public:
  DeviceRestorer() { ok_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~DeviceRestorer() {
    if (ok_) cudaSetDevice(device_);
  }
  DeviceRestorer(const DeviceRestorer&) = delete;
  DeviceRestorer& operator=(const DeviceRestorer&) = delete;

 private:
  int device_ = 0;
  bool ok_ = false;
};

}  // namespace jax_ep
