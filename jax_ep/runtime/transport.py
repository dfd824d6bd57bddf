"""The Transport protocol: how the ranks of EP groups reach each other's staging buffers.

A transport is a leaf of the runtime: it never imports the lifecycle (initialize/finalize) above it. The lifecycle
creates one per runtime, asks it for the native group set of every mesh axis, binds those axes in the native module
(`bind_axis`, so compiled programs find their buffers by axis name, never by an id baked into the program) and tears
it down at finalize. Two implementations:
  peer.PeerTransport        one process drives all local GPUs: cudaMalloc'd staging + CUDA peer access
  nvshmem.NvshmemTransport  one process per GPU: NVSHMEM symmetric buffers + nvshmem_ptr peer pointers
Both feed the same kernels (the native group holds one peer pointer per rank).
"""

from __future__ import annotations

from typing import Protocol


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
