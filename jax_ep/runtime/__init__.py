"""The runtime: lifecycle (setup / finalize), agreement between processes, and the transports as leaves.

    lifecycle.py   setup / finalize / Runtime / buffer_size_hint / backend choice (the only module with state)
    agreement.py   processes agree on a setup through the jax.distributed key-value store (kv.py: the one private
                   JAX API, behind one adapter)
    transport.py   the Transport protocol; peer.py (one process, CUDA peer access) and nvshmem.py (one process per
                   GPU) implement it; teams.py plans NVSHMEM teams; nvshmem_env.py decides NVSHMEM_* variables
Transports never import the lifecycle.
"""

from .lifecycle import (BufferSizeHint, GroupInfo, Runtime, buffer_size_hint, current, finalize, setup,
                        rdma_size_hint, resolve_backend, runtime_for_trace, staging_plan, warmup)

__all__ = ["BufferSizeHint", "GroupInfo", "Runtime", "buffer_size_hint", "current", "finalize", "setup",
           "rdma_size_hint", "resolve_backend", "runtime_for_trace", "staging_plan", "warmup"]
