"""The jax.distributed key-value client: the one private JAX API jax_ep uses, behind this one adapter.

JAX has no public accessor for the coordination service's client (key_value_set / blocking_key_value_get /
wait_at_barrier); jax_ep needs it to agree on a setup and to carry NVSHMEM's unique id before any collective.
tests/test_runtime_layers.py checks that this adapter works on the installed jax; the versions it was checked on are
listed below and in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from ..errors import EPError

# jax versions this adapter was run against (CPU CI: the lowest supported; GPU machine: the highest checked).
CHECKED_JAX_VERSIONS = ("0.10.2", "0.11.2")


def client():
    """The jax.distributed client of this process; EPError when the job has none."""
    try:
        from jax._src import distributed  # private: see the module docstring
    except ImportError as e:  # pragma: no cover - a jax that moved it
        raise EPError(f"jax_ep: this jax has no jax._src.distributed ({e}); jax_ep's key-value adapter "
                      f"(jax_ep/runtime/kv.py) was checked on jax {', '.join(CHECKED_JAX_VERSIONS)}") from None
    c = getattr(getattr(distributed, "global_state", None), "client", None)
    if c is None:
        raise EPError("jax_ep: the one-process-per-GPU transport (several JAX processes, or JAX_EP_TRANSPORT=nvshmem) "
                      "needs a jax.distributed client; call jax.distributed.initialize (python -m jax_ep.launch "
                      "does, also with -n 1) before jax_ep.initialize")
    return c


def joined_job() -> tuple[int, int] | None:
    """(process_id, num_processes) of this process's jax.distributed job, or None when it joined none; read without
    creating backends (a program may still configure devices after joining)."""
    try:
        from jax._src.distributed import global_state  # private: see the module docstring
    except ImportError:  # pragma: no cover - a jax that moved it
        return None
    if getattr(global_state, "client", None) is None:
        return None
    return int(global_state.process_id), int(global_state.num_processes)
