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
from helpers import ep_mesh


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


def test_unmapped_ranks_inside_an_nvlink_domain_are_an_initialize_error():
    """Ranks NVSHMEM cannot map (other hosts) are fine for the NVSHMEM low-latency kernels when they lie outside the
    rank's NVLink domain, and an EPError naming them and num_max_nvl_peers otherwise (the kernels would store to
    them); axes without low-latency buffers are not checked here (their normal ops are refused when they run)."""
    from jax_ep.runtime.nvshmem import check_unmapped

    check_unmapped("ep", 0, [], 0)                     # everything mapped
    check_unmapped("ep", 0, [4, 5, 6, 7], None)        # no low-latency buffers on the axis
    check_unmapped("ep", 1, [4, 5, 6, 7], 4)           # 2 hosts of 4 GPUs, num_max_nvl_peers=4
    check_unmapped("ep", 5, [0, 1, 2, 3], 4)
    check_unmapped("ep", 0, [1], 1)                    # allow_nvlink_for_low_latency=False: only itself direct
    with pytest.raises(jax_ep.EPError, match=r"ranks \[4, 5, 6, 7\].*'ep'.*NVLink kernels.*num_max_nvl_peers"):
        check_unmapped("ep", 0, [4, 5, 6, 7], 0)       # 2 hosts of 4 with the default num_max_nvl_peers=8
    with pytest.raises(jax_ep.EPError, match=r"ranks \[2, 3\].*rank 0's NVLink domain.*num_max_nvl_peers=4"):
        check_unmapped("ep", 0, [2, 3, 4, 5, 6, 7], 4)  # hosts of 2 GPUs, num_max_nvl_peers=4


def test_unmapped_ranks_inside_a_forwarding_node_are_an_initialize_error():
    """Forwarded normal-mode dispatch (EPConfig.normal_dispatch_forwarded) stores into every rank of the forwarder's
    node, so each rank checks its own node at initialize: unmapped ranks outside it are fine, inside it an EPError
    naming them (e.g. hosts of 6 GPUs with num_max_nvl_peers=4: the node of ranks 4-7 spans two hosts)."""
    from jax_ep.runtime.nvshmem import check_unmapped

    check_unmapped("ep", 1, [4, 5, 6, 7], None, 4)     # 2 hosts of 4, nodes of 4: the other node is unmapped
    check_unmapped("ep", 6, [0, 1, 2, 3], None, 4)
    check_unmapped("ep", 0, [6, 7, 8, 9, 10, 11], None, 4)  # rank 0 of a host of 6: its own node (0-3) is mapped
    with pytest.raises(jax_ep.EPError, match=r"ranks \[6, 7\].*'ep'.*rank 4's node of num_max_nvl_peers=4.*forwards"):
        check_unmapped("ep", 4, [6, 7, 8, 9, 10, 11], None, 4)  # rank 4 of the first host: 6 and 7 are elsewhere
    with pytest.raises(jax_ep.EPError, match=r"ranks \[4, 5\].*rank 7's node"):
        check_unmapped("ep", 7, [0, 1, 2, 3, 4, 5], None, 4)
    # the low-latency check still applies on the same call
    with pytest.raises(jax_ep.EPError, match="NVLink kernels"):
        check_unmapped("ep", 0, [6, 7, 8, 9, 10, 11], 0, 4)

