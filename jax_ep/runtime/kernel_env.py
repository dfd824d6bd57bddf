"""Environment variables that change what the native kernels do (not NVSHMEM's own: runtime/nvshmem_env.py).

The kernels read them once per process; `jax_ep.initialize` validates them here (EPError naming the variable) and
puts them into the fingerprint every process of a job must agree on (agreement.py), because ranks that differ would
not understand each other's messages.

- JAX_EP_LOW_LATENCY_PUT_BYTES: bytes per counted message of the NVSHMEM low-latency dispatch (nvshmem/device/low_latency.cu),
  and the most bytes per counted put of a combine row to a remote rank (the combine picks smaller parts when rows
  are few).
  A multiple of 2048 from 2048 to 65536; default 8192 (at H=7168: 2 puts-with-signal per bf16 row, 1 per fp8 row,
  each from its own warp). Smaller values split a row into more counted puts (more signals, more ordering points on
  P2P and more NIC work requests); larger ones leave fewer, longer puts per warp (docs/BENCHMARKS.md has
  the measurements).
  The kernels read it once per process, at their first launch: set it before the program starts (the launcher
  passes the environment to every process), not between calls.
- JAX_EP_PULL_COMBINE_MIN_BYTES: one process driving the group's GPUs with direct buffers on (docs/API.md, "Direct
  buffers"): a normal-mode combine whose output holds at least this many bytes reads the peers' rows itself (pull);
  smaller ones push their rows into staging. Decimal bytes, 0 or more; default 2**50 (no output is as large: every
  combine pushes). Only one process
  reads it (pull combine never spans processes), so it is not part of the fingerprint.
"""

from __future__ import annotations

import os

from ..errors import EPError

ENV_LOW_LATENCY_PUT_BYTES = "JAX_EP_LOW_LATENCY_PUT_BYTES"
LOW_LATENCY_PUT_BYTES_DEFAULT = 8192
LOW_LATENCY_PUT_BYTES_STEP = 2048
LOW_LATENCY_PUT_BYTES_MAX = 65536


def low_latency_put_bytes(environ=None) -> int:
    """The value the NVSHMEM LL dispatch kernels use: JAX_EP_LOW_LATENCY_PUT_BYTES or the default; EPError when invalid."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_LOW_LATENCY_PUT_BYTES, "").strip()
    if not raw:
        return LOW_LATENCY_PUT_BYTES_DEFAULT
    # ASCII digits only: the kernels parse the variable with atoi, which stops at the first other character ("4_096"
    # would be 4 there and 4096 for int()), and the fingerprint must hold the value the kernels use
    value = int(raw) if raw.isascii() and raw.isdigit() else -1
    if not (LOW_LATENCY_PUT_BYTES_STEP <= value <= LOW_LATENCY_PUT_BYTES_MAX and value % LOW_LATENCY_PUT_BYTES_STEP == 0):
        raise EPError(f"jax_ep.initialize: {ENV_LOW_LATENCY_PUT_BYTES}={raw!r} must be a multiple of {LOW_LATENCY_PUT_BYTES_STEP} "
                      f"from {LOW_LATENCY_PUT_BYTES_STEP} to {LOW_LATENCY_PUT_BYTES_MAX} (bytes per counted message of the NVSHMEM "
                      f"low-latency dispatch; unset: {LOW_LATENCY_PUT_BYTES_DEFAULT})")
    return value


ENV_PULL_COMBINE_MIN_BYTES = "JAX_EP_PULL_COMBINE_MIN_BYTES"
PULL_COMBINE_MIN_BYTES_DEFAULT = 1 << 50  # xla_ffi/direct_buffers.h: kPullCombineMinBytes (no output is as large)


def pull_combine_min_bytes(environ=None) -> int:
    """The value the combine handler uses: JAX_EP_PULL_COMBINE_MIN_BYTES or the default; EPError when invalid."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_PULL_COMBINE_MIN_BYTES, "")
    if not raw:
        return PULL_COMBINE_MIN_BYTES_DEFAULT
    # ASCII digits only, below 2**62: exactly what the handler's strtoll accepts as the same number
    if not (raw.isascii() and raw.isdigit() and int(raw) < 2 ** 62):
        raise EPError(f"jax_ep.initialize: {ENV_PULL_COMBINE_MIN_BYTES}={raw!r} must be a whole number of bytes, 0 or more "
                      f"(the smallest combine output that reads the peers' rows directly; unset: "
                      f"{PULL_COMBINE_MIN_BYTES_DEFAULT})")
    return int(raw)


def kernel_environment(environ=None) -> dict:
    """{variable: resolved value} for every kernel variable (validated): part of the multi-process fingerprint."""
    return {ENV_LOW_LATENCY_PUT_BYTES: low_latency_put_bytes(environ)}
