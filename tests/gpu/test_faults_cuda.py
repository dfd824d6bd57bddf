"""Faults on the GPUs (docs/RELIABILITY.md, "Stalled and missing peers"): a peer that dies (SIGKILL) or stops
(SIGSTOP) in the middle of a loop of low-latency and normal-mode ops, one process per GPU; and, in one process
driving every GPU, one GPU whose kernels never arrive (test hook JAX_EP_TEST_ABSENT_RANK). In every case the job
ends within cfg.timeout_seconds plus a margin, with a message naming the missing rank, the launcher exits non-zero,
and no process of the job is left. Program: tests/programs/gpu/fault_peer.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from helpers import cuda_gpu_count, gpu_child_env, gpu_skip_reason  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "tests", "programs", "gpu", "fault_peer.py")
TIMEOUT = 10.0   # cfg.timeout_seconds of the program: the device waits give up after it
MARGIN = 45.0    # process teardown after a trap (CUDA context destruction, the launcher's grace period)


def _ranks(nvshmem) -> int:
    """EP4 where 4 GPUs are here, else EP2 (skips below 2)."""
    found = cuda_gpu_count()
    reason = gpu_skip_reason(2, found, nvshmem=nvshmem)
    if reason:
        pytest.skip(reason)
    return min(4, found)


def _run(cmd, env=None, timeout=300):
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=gpu_child_env(**(env or {})), capture_output=True, text=True, timeout=timeout,
                       start_new_session=True)
    out = p.stdout + p.stderr
    print(f"$ {' '.join(cmd[1:])}  ({time.monotonic() - t0:.1f} s, exit {p.returncode})")
    for line in out.splitlines():
        if "RESULT" in line or "timeout after" in line or "jax_ep.launch:" in line:
            print("   ", line[:300])
    return p.returncode, out


def _fault_time(out):
    m = re.search(r"RESULT fault process=\d+ how=\w+ t=([\d.]+)", out)
    return float(m.group(1)) if m else None


def _assert_reported_once_per_waiting_gpu(out, n):
    """The device prints a timeout once per waiting GPU (cuda/common/ptx.cuh first_timeout_report), not once per
    waiting thread: at most n - 1 lines for one missing rank of n."""
    lines = len(re.findall(r"jax_ep: timeout after", out))
    assert 1 <= lines <= n - 1, f"{lines} timeout lines for {n - 1} waiting GPUs\n{out[-4000:]}"


def _assert_no_process_left(out):
    left = subprocess.run(["pgrep", "-f", "fault_peer.py"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}\n{out[-4000:]}"


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_stopped_peer_ends_the_job_naming_it(how):
    n = _ranks(nvshmem=True)
    victim = n - 1
    t0 = time.time()
    rc, out = _run([sys.executable, "-m", "jax_ep.launch", "-n", str(n), PROGRAM, "--how", how,
                    "--victim", str(victim), "--after", "3", "--timeout", str(TIMEOUT)])
    t_end = time.time()
    assert rc != 0, out[-4000:]
    fault = _fault_time(out)
    assert fault is not None, out[-4000:]
    assert t_end - fault <= TIMEOUT + MARGIN, f"ended {t_end - fault:.1f} s after the fault\n{out[-4000:]}"
    if how == "kill":  # the launcher sees the death at once and names the rank
        assert re.search(rf"jax_ep.launch: rank {victim} .*(SIGKILL|killed)", out), out[-4000:]
    else:  # alive but silent: the peers' device waits time out and name it
        assert re.search(rf"jax_ep: timeout after \d+ ns in .*rank {victim}\b", out), out[-4000:]
        _assert_reported_once_per_waiting_gpu(out, n)
    _assert_no_process_left(out)
    print(f"{how} n={n}: launcher exit {rc}, {t_end - fault:.1f} s after the fault ({t_end - t0:.1f} s in all)")


def test_an_absent_gpu_in_one_process_is_an_exception_not_a_hang():
    n = _ranks(nvshmem=False)
    victim = n - 1
    rc, out = _run([sys.executable, PROGRAM, "--how", "absent", "--victim", str(victim), "--timeout", str(TIMEOUT),
                    "--steps", "20"],
                   env={"JAX_EP_TEST_ABSENT_RANK": f"{victim}:24", "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(n))),
                        # the hook counts handler calls: XLA command buffers would replay the recorded calls without
                        # them after the second step
                        "XLA_FLAGS": "--xla_gpu_enable_command_buffer="})
    assert rc != 0, out[-4000:]
    err = re.search(r"RESULT error process=0 t=([\d.]+) kind=(\w+)", out)
    assert err, out[-4000:]
    assert re.search(rf"jax_ep: timeout after \d+ ns in .*rank {victim}\b", out), out[-4000:]
    _assert_reported_once_per_waiting_gpu(out, n)
    _assert_no_process_left(out)
