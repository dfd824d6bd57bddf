"""Low-latency mode over NVSHMEM puts (EPConfig(allow_nvlink_for_low_latency=False): nvshmem/device/low_latency.cu).

Runs the low-latency GPU suite's per_expert cases (tests/gpu/test_low_latency.py: dispatch bf16/fp8 fused and
split bit-identical to the reference backend with -1, out-of-range and repeated ids, T in {1, 64, 128} and other
shapes, combine fused and split, consecutive calls without a combine between, 100 chained steps with changing
routing, gradients; its per_rank cases skip: the NVSHMEM kernels are per_expert only) in one process per GPU
through NVSHMEM (`python -m jax_ep.launch -n 1` with JAX_EP_TRANSPORT=nvshmem; with one process the tests that
need 2 or 4 GPUs skip inside, saying so), with JAX_EP_TEST_LOW_LATENCY_OVER_NVSHMEM=1 so every config takes the
NVSHMEM kernels. Also: the errors when those kernels cannot be used.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import gpu_child_env  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _require_device_library():
    """Skips unless a GPU, the native extension and the NVSHMEM module with its device library are here (GPUs first)."""
    from cuda_backend_harness import gpu_devices
    from helpers import gpu_skip_reason  # tests/ is on sys.path

    reason = gpu_skip_reason(1, len(gpu_devices()), device_library=True)
    if reason:
        pytest.skip(reason)


def _env(**extra):
    return gpu_child_env(os.path.join(ROOT, "tests", "gpu"), **extra)


@pytest.mark.parametrize("all_remote", ["0", "1"])
def test_low_latency_suite_over_nvshmem_puts(all_remote):
    """all_remote=1 (JAX_EP_TEST_ALL_PEERS_REMOTE): every peer is treated as one NVSHMEM reaches only through a
    remote transport (staged puts with signal, NVSHMEM signal ops), the path no peer on one host takes otherwise;
    0: peers with a load/store mapping get stores and GPU atomics."""
    _require_device_library()
    cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "1", "--timeout", "540", "-m", "pytest", "-q", "-rs",
           "-p", "no:cacheprovider", os.path.join("tests", "gpu", "test_low_latency.py")]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(JAX_EP_TRANSPORT="nvshmem", JAX_EP_TEST_LOW_LATENCY_OVER_NVSHMEM="1",
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
