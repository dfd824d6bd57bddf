"""The NVSHMEM / NCCL environment jax_ep runs with: decided here and nowhere else (a leaf module, no jax_ep imports).

`FORCED_ENV` is set in every process jax_ep starts or initializes, whatever the parent environment says: NVLink
multicast (NVLS) must never be used on the machines this project runs on (it can take shared GPUs out of service).
The launcher forces it into its children; `nvshmem_environment` adds the NVSHMEM-only decisions (remote transport,
heap size) before NVSHMEM is initialized.
"""

from __future__ import annotations

import os
import re

from ..errors import EPError

FORCED_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}

HEAP_HEADROOM_BYTES = 256 << 20  # NVSHMEM's own symmetric allocations (team psync arrays, collectives scratch)
HEAP_MIN_BYTES = 1 << 30  # NVSHMEM's default symmetric size
HEAP_ROUND_BYTES = 512 << 20

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgGtT]?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """NVSHMEM's size syntax: an integer with an optional binary suffix k, m, g or t ('2G', '512M', '1073741824')."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise EPError(f"jax_ep: cannot read NVSHMEM size {text!r} (expected an integer with an optional "
                                f"k/m/g/t suffix, e.g. '4G')")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


def nvshmem_environment(required_heap_bytes: int, environ=None) -> dict:
    """The NVSHMEM_* variables jax_ep runs NVSHMEM with (applied before NVSHMEM init).

    - FORCED_ENV, always: NVLink multicast stays off.
    - NVSHMEM_REMOTE_TRANSPORT=none unless set: jax_ep moves data only over NVLink through nvshmem_ptr peer
      pointers today, so a remote (NIC) transport is never needed, and with no NIC its init fails noisily.
    - NVSHMEM_SYMMETRIC_SIZE: unless set, large enough for jax_ep's buffers plus NVSHMEM's own (at least NVSHMEM's
      1 GiB default); a user value smaller than what the configs need is an error naming both numbers.
    Every other NVSHMEM variable is left to the user.
    """
    environ = os.environ if environ is None else environ
    need = int(required_heap_bytes) + HEAP_HEADROOM_BYTES
    env = {"NVSHMEM_DISABLE_NVLS": FORCED_ENV["NVSHMEM_DISABLE_NVLS"],
           "NVSHMEM_REMOTE_TRANSPORT": environ.get("NVSHMEM_REMOTE_TRANSPORT") or "none"}
    user = environ.get("NVSHMEM_SYMMETRIC_SIZE")
    if user:
        if parse_size(user) < need:
            raise EPError(
                f"jax_ep.initialize: NVSHMEM_SYMMETRIC_SIZE={user} ({parse_size(user)} bytes) is too small: these "
                f"configs need {required_heap_bytes} bytes of symmetric buffers plus {HEAP_HEADROOM_BYTES} for "
                f"NVSHMEM itself = {need} bytes; raise it or unset it (jax_ep then sizes the heap)")
        env["NVSHMEM_SYMMETRIC_SIZE"] = user
    else:
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(max(HEAP_MIN_BYTES, -(-need // HEAP_ROUND_BYTES) * HEAP_ROUND_BYTES))
    return env
