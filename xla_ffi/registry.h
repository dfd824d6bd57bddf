// The one list of FFI target names and handler symbols. module.cc turns it into registrations() (stateless targets:
// one execute handler; group-using targets: an {instantiate, execute} bundle whose state type is OpState) and
// target_names() (op -> versioned target name, which Python reads instead of spelling the names again); each
// handler reports errors under its name from here. A changed operand or attribute list gets a new version, in the
// name and in the symbols alike, never a silent reinterpretation.
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_ep::targets {
inline constexpr const char* kLayout = "jax_ep_layout_v1";
inline constexpr const char* kDispatch = "jax_ep_dispatch_v4";
inline constexpr const char* kCachedDispatch = "jax_ep_cached_dispatch_v4";
inline constexpr const char* kCombine = "jax_ep_combine_v4";
inline constexpr const char* kLowLatencyDispatch = "jax_ep_low_latency_dispatch_v6";
inline constexpr const char* kLowLatencyDispatchSend = "jax_ep_low_latency_dispatch_send_v6";
inline constexpr const char* kLowLatencyDispatchRecv = "jax_ep_low_latency_dispatch_recv_v6";
inline constexpr const char* kLowLatencyCombine = "jax_ep_low_latency_combine_v6";
inline constexpr const char* kLowLatencyCombineSend = "jax_ep_low_latency_combine_send_v6";
inline constexpr const char* kLowLatencyCombineRecv = "jax_ep_low_latency_combine_recv_v6";
}  // namespace jax_ep::targets

// layout (stateless)
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayoutCpuV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayoutCudaV1);

// normal mode
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCachedDispatchInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCachedDispatchCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCombineInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCombineCudaV4);

// low-latency mode
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchInstantiateV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchCudaV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchSendInstantiateV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchSendCudaV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchRecvInstantiateV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchRecvCudaV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineInstantiateV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineCudaV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineSendInstantiateV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineSendCudaV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineRecvInstantiateV6);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineRecvCudaV6);
