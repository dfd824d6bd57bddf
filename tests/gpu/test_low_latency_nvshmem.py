"""Low-latency mode over NVSHMEM puts (EPConfig(allow_nvlink_for_low_latency=False): nvshmem/device/ll_rdma.cu).

Runs the whole low-latency GPU suite (tests/gpu/test_low_latency.py: dispatch bf16/fp8 bit-identical to the
reference backend with -1, out-of-range and repeated ids, T in {1, 64, 128} and other shapes, combine fused and
split, consecutive calls without a combine between, 100 chained steps with changing routing, gradients) in one
process per GPU through NVSHMEM (`python -m jax_ep.launch -n 1` with JAX_EP_TRANSPORT=nvshmem; with one process
the tests that need 2 or 4 GPUs skip inside, saying so), with JAX_EP_TEST_LL_OVER_NVSHMEM=1 so every config takes
the NVSHMEM kernels. Also: the errors when those kernels cannot be used.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _require_device_library():
    from jax_ep import _native
    from jax_ep.runtime import nvshmem as nvshmem_runtime
    from intranode_harness import require

    require(1)
    if nvshmem_runtime.availability() != "available":
        pytest.skip(nvshmem_runtime.availability())
    if not nvshmem_runtime.module().has_device_library():
        pytest.skip("jax_ep._jax_ep_nvshmem was built without NVSHMEM's device library")
    assert _native.available()


def _env(**extra):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0",
               PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "gpu")] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


@pytest.mark.parametrize("all_remote", ["0", "1"])
def test_low_latency_suite_over_nvshmem_puts(all_remote):
    """all_remote=1 (JAX_EP_TEST_ALL_PEERS_REMOTE): every peer is treated as one NVSHMEM reaches only through a
    remote transport (staged puts with signal, NVSHMEM signal ops), the path no peer on one host takes otherwise;
    0: peers with a load/store mapping get stores and GPU atomics."""
    _require_device_library()
    cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "1", "--timeout", "540", "-m", "pytest", "-q", "-rs",
           "-p", "no:cacheprovider", os.path.join("tests", "gpu", "test_low_latency.py")]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(JAX_EP_TRANSPORT="nvshmem", JAX_EP_TEST_LL_OVER_NVSHMEM="1",
                                               JAX_EP_TEST_ALL_PEERS_REMOTE=all_remote),
                       capture_output=True, text=True, timeout=600)
    tail = p.stdout[-5000:] + "\n--- stderr ---\n" + p.stderr[-5000:]
    print(tail)
    assert p.returncode == 0, tail
    m = re.search(r"(\d+) passed", p.stdout)
    assert m and int(m.group(1)) >= 20, tail


def test_nvlink_only_transport_refuses_nvshmem_low_latency():
    """One process driving the GPU (peer transport): allow_nvlink_for_low_latency=False is an EPError at
    initialize that says what to do, not a failure inside the first call."""
    _require_device_library()
    code = ("import numpy as np, jax, jax_ep\n"
            "from jax.sharding import Mesh\n"
            "mesh = Mesh(np.array(jax.devices('gpu')[:1]), ('ep',))\n"
            "cfg = jax_ep.EPConfig(8, 256, 2, 8, backend='cuda', allow_nvlink_for_low_latency=False)\n"
            "try:\n"
            "    jax_ep.initialize(mesh, cfg)\n"
            "except jax_ep.EPError as e:\n"
            "    print('EPError:', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert "EPError:" in p.stdout and "allow_nvlink_for_low_latency=False" in p.stdout, p.stdout + p.stderr
    assert "one process per GPU" in p.stdout, p.stdout
