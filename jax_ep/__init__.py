"""jax_ep: expert-parallel (MoE) dispatch/combine for JAX.

Ops run inside `jax.shard_map` over `EPConfig.axis_name`; see README.md, docs/API.md and docs/SPEC.md.
Layers (docs/ARCHITECTURE.md): config.py, types.py, errors.py, fp8.py and ops/ are the public API (ops/initialize.py:
`initialize` = runtime setup + one warm-up run of the ops); backends/ runs the ops; runtime/ sets up transports;
launch/ starts processes; bench/ measures.
"""

from . import fp8
from .config import EPConfig
from .errors import EPError, EPTypeError
from .types import (DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyCombinePending,
                     LowLatencyDispatchOutput, LowLatencyDispatchPending, LowLatencyHandle, LowLatencyState)
from .ops.low_latency import (check_low_latency_state, low_latency_combine, low_latency_combine_recv,
                               low_latency_combine_send, low_latency_dispatch, low_latency_dispatch_recv,
                               low_latency_dispatch_send, low_latency_state)
from .ops.normal import capacity_mask, combine, dispatch, get_dispatch_layout
from .runtime import BufferSizeHint, Runtime, buffer_size_hint, finalize, rdma_size_hint, warmup
from .runtime.nvshmem_env import NvshmemSettings, nvshmem_env
from .ops.initialize import initialize

__version__ = "0.1.0"

__all__ = [
    "EPConfig", "initialize", "finalize", "warmup", "buffer_size_hint", "rdma_size_hint", "Runtime", "BufferSizeHint",
    "get_dispatch_layout", "dispatch", "combine", "capacity_mask",
    "low_latency_state", "check_low_latency_state", "LowLatencyState",
    "low_latency_dispatch", "low_latency_combine", "low_latency_dispatch_send", "low_latency_dispatch_recv",
    "low_latency_combine_send", "low_latency_combine_recv",
    "DispatchLayout", "DispatchOutput", "DispatchHandle", "LowLatencyDispatchOutput", "LowLatencyHandle",
    "LowLatencyDispatchPending", "LowLatencyCombinePending", "EPError", "EPTypeError", "fp8",
    "nvshmem_env", "NvshmemSettings",
]
