"""The Transport protocol: how the ranks of EP groups reach each other's staging buffers.

A transport is a leaf of the runtime: it never imports the lifecycle (initialize/finalize) above it. The lifecycle
creates one per runtime, asks it for the native group set of every mesh axis, binds those axes in the native module
(`bind_axis`, so compiled programs find their buffers by axis name, never by an id baked into the program) and tears
it down at finalize. Two implementations:
  peer.PeerTransport        one process drives all local GPUs: cudaMalloc'd staging + CUDA peer access
  nvshmem.NvshmemTransport  one process per GPU: NVSHMEM symmetric buffers + nvshmem_ptr peer pointers
Both feed the same kernels (the native group holds one peer pointer per rank).

Which one: NVSHMEM whenever the job has several processes; with one process, the peer transport unless the
environment variable JAX_EP_TRANSPORT=nvshmem asks for NVSHMEM (`requested`). That runs a one-process job (one GPU,
started with `python -m jax_ep.launch -n 1`, which joins jax.distributed) through exactly the one-process-per-GPU
path: NVSHMEM bootstrap, teams, symmetric buffers, the device-API check. It is how that path is tested on a machine
with one GPU, and how a user checks an NVSHMEM installation before a multi-node run.
"""

from __future__ import annotations

import os
from typing import Protocol

from ..errors import EPError

ENV_TRANSPORT = "JAX_EP_TRANSPORT"
_TRANSPORT_VALUES = ("auto", "nvshmem")


def requested() -> str:
    """'auto' (default: NVSHMEM with several processes, peer access with one) or 'nvshmem' (always), from
    JAX_EP_TRANSPORT; EPError naming the variable for any other value."""
    value = os.environ.get(ENV_TRANSPORT, "auto").strip().lower() or "auto"
    if value not in _TRANSPORT_VALUES:
        raise EPError(f"jax_ep: {ENV_TRANSPORT}={os.environ.get(ENV_TRANSPORT)!r} must be one of "
                      f"{', '.join(_TRANSPORT_VALUES)}")
    return value


class Transport(Protocol):
    name: str  # "cuda-peer" or "nvshmem" (Runtime.transport)

    def set_id(self, axis: str) -> int:
        """Native group-set id of the mesh axis `axis` in this process (what `bind_axis` binds the axis to)."""

    def group_ids(self) -> list[int]:
        """Every native group this transport created in this process."""

    def summary(self) -> dict:
        """What was set up (for Runtime.summary / logs): teams, buffer bytes, versions."""

    def teardown(self, timeout_s: float) -> None:
        """Releases the groups and buffers (collective for NVSHMEM: every process calls it)."""
