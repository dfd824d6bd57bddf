// Every FFI handler symbol of the module. module.cc turns this list into registrations() (stateless targets: one
// execute handler; group-using targets: an {instantiate, execute} bundle whose state type is OpState). Target
// names are versioned: a changed operand or attribute list gets a new name, never a silent reinterpretation.
#pragma once

#include "xla/ffi/api/api.h"

// routing (stateless): jax_ep_layout_v1
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayoutCpuV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayoutCudaV1);

// normal mode: jax_ep_dispatch_v3, jax_ep_cached_dispatch_v3, jax_ep_combine_v3
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchInstantiateV3);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchCudaV3);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCachedDispatchInstantiateV3);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCachedDispatchCudaV3);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCombineInstantiateV3);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCombineCudaV3);

// low-latency mode: jax_ep_ll_dispatch_v5, jax_ep_ll_dispatch_send_v5, ..._recv_v5, jax_ep_ll_combine_v5, ...
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchSendInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchSendCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchRecvInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlDispatchRecvCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineSendInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineSendCudaV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineRecvInstantiateV4);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLlCombineRecvCudaV4);
