"""One process per GPU with the CUDA backend (NVSHMEM teams and symmetric buffers), on the GPU machine.

Runs tests/programs/gpu/one_process_per_gpu.py under `python -m jax_ep.launch -n 4` and `-n 2` and, for comparison, as
one process driving the same GPUs: normal-mode dispatch (bf16, fp8), combine and gradients against the reference
backend in the same processes; team membership and sizes for several (R, num_max_nvl_peers); finalize + initialize
again; a config mismatch between processes ending in an error that names it; and bit-identical outputs in both
process models. Skips (saying why) where there are not enough GPUs, or the native / NVSHMEM modules are missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import gpu_child_env, gpu_skip_reason  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAMS = os.path.join(ROOT, "tests", "programs", "gpu")
SCRIPT = os.path.join(PROGRAMS, "one_process_per_gpu.py")


def _require(n, device_library=False):
    """Skips unless n GPUs (counted by nvidia-smi: no CUDA context in this process), the native extension and the
    NVSHMEM module (device_library: built with NVSHMEM's device library) are here; the GPUs are checked first."""
    reason = gpu_skip_reason(n, nvshmem=True, device_library=device_library)
    if reason:
        pytest.skip(reason)


def _env(extra=None):
    return gpu_child_env(**(extra or {}))


def _run(cmd, timeout=240, env=None):
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout)
    dt = time.monotonic() - t0
    print(f"$ {' '.join(cmd[2:])}  ({dt:.1f} s, exit {p.returncode})")
    for line in p.stdout.splitlines():
        if "RESULT" in line:
            print("   ", line[:400])
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout ---\n{p.stdout[-6000:]}\n--- stderr ---\n{p.stderr[-6000:]}"
    # the exit hook (jax_ep runtime teardown, then nvshmem finalize after a bounded barrier) ran cleanly everywhere
    for bad in ("NVSHMEM not finalized at exit", "finalize at exit failed", "shutdown at exit failed"):
        assert bad not in p.stderr, f"{bad!r} in stderr:\n{p.stderr[-6000:]}"
    return p.stdout


def _launch(n, *args, timeout=240, env=None):
    return _run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), "--timeout", str(timeout - 20), SCRIPT,
                 *args], timeout=timeout, env=env)


def _single(*args, timeout=240):
    return _run([sys.executable, SCRIPT, *args], timeout=timeout)


def _decoded(v):
    """float64 values of an array one_process_per_gpu.py saved (bf16 as its uint16 bits, f32 as is)."""
    import ml_dtypes

    return v.view(ml_dtypes.bfloat16).astype(np.float64) if v.dtype == np.uint16 else v.astype(np.float64)


def _lines(out, tag):
    return {int(m.group(1)): m.group(2) for m in re.finditer(rf"^\[rank (\d+)\] RESULT {tag} process=\d+ (.*)$",
                                                              out, re.M)}


# (n, nvl): nvl < n runs the NVSHMEM kernels (simulated nodes of nvl GPUs); nvl = n the NVLink kernels through
# NVSHMEM's peer pointers, with low_latency_mode="per_rank" too (it has NVLink kernels only). pools: XLA's preallocation
# on, so every process maps every peer's pool and dispatch takes direct receive (receive pools); off, dispatch goes
# through staging (send_copy_kernel).
@pytest.mark.parametrize("n,nvl,pools", [(4, 2, False), (2, 1, False), (4, 4, True), (2, 2, False)])
def test_one_process_per_gpu_matches_reference_and_single_process(n, nvl, pools, tmp_path):
    _require(n)
    multi, single = str(tmp_path / "multi.npz"), str(tmp_path / "single.npz")
    out = _launch(n, "--out", multi, "--nvl", str(nvl), "--mismatch",
                  env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true" if pools else "false"})
    for tag in ("runtime", "receive_pools", "device_check", "teams", "normal_kernels", "correctness", "reinitialize",
                "mismatch", "after_mismatch", "done"):
        assert sorted(_lines(out, tag)) == list(range(n)), f"{tag} missing from some rank\n{out}"
    for line in _lines(out, "normal_kernels").values():  # R > num_max_nvl_peers: the NVSHMEM normal-mode kernels
        assert f"nvshmem=[{int(n > nvl)}]" in line, line
    for line in _lines(out, "runtime").values():
        assert "model=multi-process transport=nvshmem" in line, line
    for line in _lines(out, "receive_pools").values():  # none where normal mode runs the NVSHMEM kernels (nvl < n)
        states = list(json.loads(line.split("pools=", 1)[1]).values())
        assert len(states) == int(nvl >= n), line
        assert all(s == "on" if pools else s.startswith("off: ") for s in states), line
    for line in _lines(out, "correctness").values():  # dispatch calls that took direct receive
        calls = int(re.search(r"direct_calls=(\d+)", line).group(1))
        assert (calls > 0) == pools, line
    for line in _lines(out, "device_check").values():
        assert f"n_pes={n} complete={n}" in line or "ran=False" in line, line
    for line in _lines(out, "mismatch").values():
        assert float(re.search(r"seconds=([\d.]+)", line).group(1)) < 10, line
        assert "configs[0].hidden" in line or "configs[1].hidden" in line, line
    out1 = _single("--ranks", str(n), "--out", single)  # num_max_nvl_peers 8: the NVLink kernels, per_rank too
    assert "model=single-process transport=cuda-peer" in out1
    a, b = dict(np.load(multi)), dict(np.load(single))
    if nvl < n:  # the multi-process run had no per_rank LL to compare
        b = {k: v for k, v in b.items() if not (k.startswith("ll_pr_") or k == "y_ll_pr")}
    assert sorted(a) == sorted(b) and len(a) >= 15, sorted(a)
    assert ("y_ll_pr" in a) == (nvl >= n), sorted(a)  # per_rank LL ran where its NVLink kernels can
    # nodes of nvl < n GPUs: node-first combine sums each node's rows first, so what a combine produces (y*, and the
    # gradients through dispatch, whose VJP is a combine) is within f32-accumulation tolerance of the flat sum
    # (SPEC); everything else bit-identical
    for k in sorted(a):
        if n > nvl > 1 and (k.startswith("y") or k.startswith("grad")):
            got, want = _decoded(a[k]), _decoded(b[k])  # one_process_per_gpu.py saves bf16 as its bits (uint16)
            err = np.max(np.abs(got - want)) if want.size else 0.0
            assert err <= 2 ** -6 * max(1.0, np.max(np.abs(want)) if want.size else 1.0), (k, err)
            continue
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k}: one process per GPU != one process, {n} GPUs")


def test_one_gpu_through_the_nvshmem_path_matches_reference_and_peer_path(tmp_path):
    """JAX_EP_TRANSPORT=nvshmem with one process on one GPU: NVSHMEM bootstrap with the device library, the
    device-API check (counted put-with-signal messages), a team of one, symmetric buffers, then every op of
    one_process_per_gpu.py bit-identical to the reference backend and to the same program over the peer transport."""
    _require(1)
    via, peer = str(tmp_path / "nvshmem.npz"), str(tmp_path / "peer.npz")
    out = _launch(1, "--out", via, env={"JAX_EP_TRANSPORT": "nvshmem"})
    for tag in ("runtime", "device_check", "teams", "correctness", "reinitialize", "done"):
        assert sorted(_lines(out, tag)) == [0], f"{tag} missing\n{out}"
    assert "model=multi-process transport=nvshmem" in _lines(out, "runtime")[0]
    from jax_ep.runtime import nvshmem as nvshmem_runtime

    # the device-API check runs exactly when the module has NVSHMEM's device library, and then every message arrived
    want = ("ran=True", "complete=1") if nvshmem_runtime.module().has_device_library() else ("ran=False",)
    assert all(w in _lines(out, "device_check")[0] for w in want), (want, _lines(out, "device_check")[0])
    out1 = _single("--ranks", "1", "--out", peer)
    assert "model=single-process transport=cuda-peer" in out1
    a, b = dict(np.load(via)), dict(np.load(peer))
    assert sorted(a) == sorted(b) and len(a) >= 15, sorted(a)
    for k in sorted(a):
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{k}: NVSHMEM path != peer path, one GPU")


@pytest.mark.parametrize("n,flags", [
    (1, ("--ll-over-nvshmem",)),   # JAX_EP_TRANSPORT=nvshmem, one process: the rank itself is the one peer
    (2, ("--ll-over-nvshmem",)),   # allow_nvlink_for_low_latency=False: puts to the other rank
    (2, ()),                       # R=2 > num_max_nvl_peers=1: the NVSHMEM kernels by themselves (2 nodes of 1)
    (4, ()),                       # 4 nodes of 1: L=72, so the expert kernels run several blocks per expert
])
def test_low_latency_over_nvshmem_puts_matches_reference(n, flags):
    """The LL rows moved by NVSHMEM put-with-signal (nvshmem/device/low_latency.cu) between simulated nodes of one GPU
    (num_max_nvl_peers=1): one_process_per_gpu.py's whole program bit-identical to the reference backend, and its
    lowered LL calls carry nvshmem = 1 (the NVSHMEM kernels), whether chosen by allow_nvlink_for_low_latency=False
    or by R > nvl."""
    _require(n, device_library=True)
    out = _launch(n, "--nvl", "1", *flags, env={"JAX_EP_TRANSPORT": "nvshmem"})
    for tag in ("runtime", "device_check", "ll_kernels", "normal_kernels", "correctness", "reinitialize", "done"):
        assert sorted(_lines(out, tag)) == list(range(n)), f"{tag} missing from some rank\n{out}"
    for line in _lines(out, "ll_kernels").values():
        assert "nvshmem=[1]" in line, line
    # normal mode: the NVSHMEM kernels exactly when R > num_max_nvl_peers (nvshmem/device/normal_send.cu)
    for line in _lines(out, "normal_kernels").values():
        assert f"nvshmem=[{int(n > 1)}]" in line, line


def test_group_across_simulated_hosts():
    """Two processes that NVSHMEM may not map to each other (JAX_EP_TEST_RANKS_PER_HOST=1: no load/store pointer
    between ranks of different simulated hosts, as across real hosts): initialize reports the unmapped rank; 100
    low-latency steps and 100 normal-mode steps with new routing match the reference backend through NVSHMEM puts
    alone, a gradient through dispatch and combine too; the bytes put across the boundary (a device counter) are one
    LL message per (token, expert on the other host) and one normal-mode copy per (token, rank on the other host)
    (tests/programs/gpu/low_latency_across_hosts.py)."""
    _require(2, device_library=True)
    script = os.path.join(PROGRAMS, "low_latency_across_hosts.py")
    out = _run([sys.executable, "-m", "jax_ep.launch", "-n", "2", "--timeout", "200", script, "--nvl", "1"],
               env={"JAX_EP_TEST_RANKS_PER_HOST": "1", "JAX_EP_TEST_COUNT_REMOTE_BYTES": "1"})
    for tag in ("unmapped", "teams", "low_latency", "remote_bytes", "normal", "normal_remote_bytes", "done"):
        assert sorted(_lines(out, tag)) == [0, 1], f"{tag} missing from some rank\n{out}"
    assert _lines(out, "unmapped") == {0: "ranks=[1]", 1: "ranks=[0]"}, out


def _mps_running() -> bool:
    """Whether a CUDA MPS control daemon serves this environment's pipe directory (several NVSHMEM PEs per GPU
    need it: without MPS, NVSHMEM exits on team splits and barriers)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


# (processes, processes per GPU, num_max_nvl_peers): EP2 on one GPU (2 nodes of 1); EP4 on two GPUs (2 nodes of 2,
# NVLink peers and NVSHMEM puts in one group); EP8 as 2 nodes of 4; EP16 as 2 nodes of 8 (two 8-GPU hosts: the
# first group over kMaxNvlPeers ranks, on the NVSHMEM kernels' 32-slot send path); EP32 as 4 nodes of 8
# (kMaxGroupRanks) with fewer steps and tokens: each process holds every rank's inputs on the host, and 32 processes
# with the default sizes ran out of host memory on a 256 GiB machine.
SHARED_GPU_CASES = [(2, 2, 1, ()), (4, 2, 2, ()), (8, 4, 4, ()), (16, 8, 8, ()),
                    (32, 16, 8, ("--steps", "20", "--tokens", "16")),
                    # EP64 as 8 nodes of 8 (kMaxGroupRanks: groups up to 256) on 4 GPUs: 16 processes per GPU, the
                    # most one MPS server carries with spinning receive kernels (32 per GPU fail at any R:
                    # docs/RELIABILITY.md); few steps and tokens (every process holds every rank's inputs)
                    (64, 16, 8, ("--steps", "5", "--tokens", "4"))]


@pytest.mark.parametrize("n,per_gpu,nvl,extra", SHARED_GPU_CASES)
def test_group_larger_than_the_gpus_across_simulated_hosts(n, per_gpu, nvl, extra):
    """EP groups with more ranks than GPUs: `jax_ep.launch --processes-per-gpu P` puts P processes (NVSHMEM PEs) on
    each GPU under CUDA MPS; ranks of different simulated hosts (JAX_EP_TEST_RANKS_PER_HOST = num_max_nvl_peers)
    get no pointers to each other. low_latency_across_hosts.py then checks low-latency and normal-mode steps, a
    gradient and the bytes put across the boundary against the reference backend, which runs on the processes' CPU
    devices (--oracle cpu: NCCL refuses two ranks on one GPU). Runs only while an MPS daemon is up
    (`scripts/gpu.sh shared-gpu` starts one)."""
    _require(-(-n // per_gpu), device_library=True)
    if not _mps_running():
        pytest.skip("needs the CUDA MPS daemon running (several processes per GPU); `scripts/gpu.sh "
                    "shared-gpu` starts one for this test")
    script = os.path.join(PROGRAMS, "low_latency_across_hosts.py")
    out = _run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), "--processes-per-gpu", str(per_gpu),
                "--timeout", "260", script, "--nvl", str(nvl), "--oracle", "cpu", *extra], timeout=280,
               env={"JAX_EP_TEST_RANKS_PER_HOST": str(nvl), "JAX_EP_TEST_COUNT_REMOTE_BYTES": "1"})
    for tag in ("unmapped", "teams", "low_latency", "remote_bytes", "normal", "normal_remote_bytes", "done"):
        assert sorted(_lines(out, tag)) == list(range(n)), f"{tag} missing from some rank\n{out}"
    want = {r: f"ranks={[q for q in range(n) if q // nvl != r // nvl]}" for r in range(n)}
    assert _lines(out, "unmapped") == want, out


def test_two_launchers_form_one_ep2_job_over_nvshmem(tmp_path):
    """Issue 14, item 5 on GPUs: two launcher invocations on one host (as on two hosts: --num-hosts 2
    --host-index i --coordinator), each -n 1 with its own CUDA_VISIBLE_DEVICES, form one EP2 job;
    one_process_per_gpu.py then runs with num_max_nvl_peers=1 (two "nodes" of one GPU) and the low-latency rows over
    NVSHMEM puts, checked against the reference backend on every process."""
    _require(2)
    from jax_ep.launch.plan import free_port

    port = free_port()
    procs = []
    try:
        for h in (1, 0):  # the job waits for host 0's coordinator
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jax_ep.launch", "-n", "1", "--num-hosts", "2", "--host-index", str(h),
                 "--coordinator", f"127.0.0.1:{port}", "--timeout", "220", SCRIPT, "--nvl", "1",
                 "--ll-over-nvshmem"], cwd=ROOT, env=_env({"CUDA_VISIBLE_DEVICES": str(h)}),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join(o + e for o, e in outs)
    assert [p.returncode for p in procs] == [0, 0], text[-8000:]
    out = "".join(o for o, _ in outs)
    for tag in ("runtime", "device_check", "teams", "correctness", "done"):
        assert sorted(_lines(out, tag)) == [0, 1], f"{tag} missing from some rank\n{text[-8000:]}"
    for line in _lines(out, "device_check").values():
        assert "n_pes=2 complete=2" in line, line


@pytest.mark.parametrize("n,dp,nvl,want_sizes,exit_hook", [
    (4, 1, 8, [4], False),              # R = 4 fits one NVLink domain: no sub team
    (4, 1, 2, [4, 2, 2, 2, 2], False),  # two "nodes" of two: RDMA teams {0, 2}, {1, 3}; NVLink teams {0, 1}, {2, 3}
    (4, 1, 1, [4, 4], True),            # one GPU per "node": the sub team is the whole group
    (4, 2, 1, [2, 2, 2, 2], False),     # (dp=2, ep=2): two groups, each with its sub team
    (2, 1, 1, [2, 2], True),
])
def test_team_membership_and_sizes(n, dp, nvl, want_sizes, exit_hook):
    """exit_hook: the program does not call finalize; the exit hook tears down and finalizes NVSHMEM (no hang)."""
    _require(n)
    out = _launch(n, "--teams-only", "--dp", str(dp), "--nvl", str(nvl), *(["--no-finalize"] if exit_hook else []),
                  timeout=120)
    teams = _lines(out, "teams")
    assert sorted(teams) == list(range(n)), out
    for r, line in teams.items():
        sizes = [int(s) for s in re.search(r"sizes=\[([\d, ]*)\]", line).group(1).split(",")]
        assert sizes == want_sizes, line
