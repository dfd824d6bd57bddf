// Every FFI handler symbol of the module. module.cc turns this list into registrations(); target names are
// versioned (suffix _v1): a changed operand list gets a new name, never a silent reinterpretation.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayoutCpuV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLayoutCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpDispatchCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCachedDispatchCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpCombineCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchSendCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchRecvCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineSendCudaV1);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxEpLowLatencyCombineRecvCudaV1);
