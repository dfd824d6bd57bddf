"""JAX_EP_TRANSPORT (jax_ep/runtime/transport.py): which transport CUDA configs use with one process.

'auto' (default) keeps peer access for one process and NVSHMEM for several; 'nvshmem' sends a one-process job
through the one-process-per-GPU path (checked on the GPU machine by
tests/gpu/test_multiprocess_cuda.py::test_one_gpu_through_the_nvshmem_path_matches_reference_and_peer_path). Here:
the parsing, the error that names the variable, and that reference-only configs are unaffected.
"""

from __future__ import annotations

import pytest

import jax_ep
from jax_ep.runtime import transport
from tests.helpers import ep_mesh


@pytest.mark.parametrize("value,want", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("nvshmem", "nvshmem"),
                                        (" NVSHMEM ", "nvshmem")])
def test_values(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(transport.ENV_TRANSPORT, raising=False)
    else:
        monkeypatch.setenv(transport.ENV_TRANSPORT, value)
    assert transport.requested() == want


def test_bad_value_names_the_variable_at_initialize(monkeypatch):
    monkeypatch.setenv(transport.ENV_TRANSPORT, "ibgda")
    with pytest.raises(jax_ep.EPError, match=r"JAX_EP_TRANSPORT='ibgda' must be one of auto, nvshmem"):
        transport.requested()
    cfg = jax_ep.EPConfig(8, 128, 2, 4, backend="reference")
    try:
        with pytest.raises(jax_ep.EPError, match="JAX_EP_TRANSPORT"):
            jax_ep.initialize(ep_mesh(2), cfg)
    finally:
        jax_ep.finalize()


def test_reference_configs_ignore_nvshmem_request(monkeypatch):
    """The variable only decides where CUDA configs' buffers live; a reference-only runtime stays transport-free
    (no jax.distributed needed)."""
    monkeypatch.setenv(transport.ENV_TRANSPORT, "nvshmem")
    cfg = jax_ep.EPConfig(8, 128, 2, 4, backend="reference")
    try:
        rt = jax_ep.initialize(ep_mesh(2), cfg)
        assert rt.process_model == "single-process" and rt.transport == "xla-collectives", rt.summary()
    finally:
        jax_ep.finalize()


def test_simulated_hosts_hook(monkeypatch):
    """JAX_EP_TEST_RANKS_PER_HOST=k: ranks r, q are on one simulated host iff r // k == q // k (the GPU test of a
    group across hosts relies on it); unset: every rank counts as mapped; a bad value names the variable."""
    from jax_ep.runtime import nvshmem as nvshmem_runtime

    same = nvshmem_runtime._same_simulated_host
    monkeypatch.delenv("JAX_EP_TEST_RANKS_PER_HOST", raising=False)
    assert all(same(r, q) for r in range(4) for q in range(4))
    monkeypatch.setenv("JAX_EP_TEST_RANKS_PER_HOST", "2")
    assert [[same(r, q) for q in range(4)] for r in range(4)] == [[r // 2 == q // 2 for q in range(4)] for r in range(4)]
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("JAX_EP_TEST_RANKS_PER_HOST", bad)
        with pytest.raises(jax_ep.EPError, match="JAX_EP_TEST_RANKS_PER_HOST"):
            same(0, 1)
