"""jax_ep: expert-parallel (MoE) dispatch/combine for JAX.

Ops run inside `jax.shard_map` over `EPConfig.axis_name`; see README.md and docs/API.md.
"""

from .config import EPConfig
from .handle import (DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyCombinePending,
                     LowLatencyDispatchOutput, LowLatencyDispatchPending, LowLatencyHandle)
from .ops import (combine, dispatch, get_dispatch_layout, low_latency_combine, low_latency_combine_recv,
                  low_latency_combine_send, low_latency_dispatch, low_latency_dispatch_recv,
                  low_latency_dispatch_send)
from .runtime import BufferSizeHint, Runtime, buffer_size_hint, finalize, initialize
from . import fp8
from .validation import EPError, EPTypeError

__version__ = "0.1.0"

__all__ = [
    "EPConfig", "initialize", "finalize", "buffer_size_hint", "Runtime", "BufferSizeHint",
    "get_dispatch_layout", "dispatch", "combine",
    "low_latency_dispatch", "low_latency_combine", "low_latency_dispatch_send", "low_latency_dispatch_recv",
    "low_latency_combine_send", "low_latency_combine_recv",
    "DispatchLayout", "DispatchOutput", "DispatchHandle", "LowLatencyDispatchOutput", "LowLatencyHandle",
    "LowLatencyDispatchPending", "LowLatencyCombinePending", "EPError", "EPTypeError",
]
