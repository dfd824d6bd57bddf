"""What a user meets outside one process, on CPU: host-side helpers on global arrays, the launcher's job summary and
its device-count rule, the reliability bench under the launcher (issue-level checks of docs/PROCESS_MODELS.md)."""
import os
import re
import subprocess
import sys
import time

import pytest

from helpers import cpu_child_env  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "programs", "cpu")


def launch(args, timeout=240):
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch"] + args, cwd=ROOT, env=cpu_child_env(),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_check_low_latency_state_takes_a_global_array_in_a_job_of_two_processes():
    rc, out = launch(["-n", "2", os.path.join(PROGRAMS, "state_check.py"), "--case", "ok"])
    assert rc == 0, out
    assert len(re.findall(r"RESULT ok process=\d raised=none", out)) == 2, out


def test_check_low_latency_state_names_this_process_ranks_when_misordered():
    rc, out = launch(["-n", "2", os.path.join(PROGRAMS, "state_check.py"), "--case", "misordered"])
    assert rc == 0, out
    for pid, ranks in ((0, "[0, 1]"), (1, "[2, 3]")):
        line = re.search(rf"RESULT misordered process={pid} raised=EPError message=(.*)", out)
        assert line, out
        assert f"rank(s) {ranks}" in line.group(1) and "two sends of this chain" in line.group(1), line.group(1)


def _hello(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text('import os\nos.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")\n'
                      'import jax\nfrom jax.experimental import multihost_utils\n'
                      'multihost_utils.sync_global_devices("hello")  # a cross-process collective: Gloo connects\n'
                      '# one write: Gloo threads print to the same stream between the pieces of a multi-argument\n'
                      '# print when stdout is unbuffered\n'
                      'import sys\n'
                      'sys.stdout.write(f"DEVICES {len(jax.devices())} {len(jax.local_devices())}\\n"); sys.stdout.flush()\n')
    return str(script)


@pytest.mark.parametrize("flag,per_process", [([], 1), (["--cpu-devices", "3"], 3)])
def test_launcher_says_the_job_shape_and_sets_the_cpu_devices_whatever_the_script_sets(tmp_path, flag, per_process):
    rc, out = launch(["-n", "2"] + flag + [_hello(tmp_path)])
    assert rc == 0, out
    assert (f"jax_ep.launch: job: 2 processes x {per_process} CPU device{'s' if per_process > 1 else ''} each" in out
            and f"an EP axis over every device has {2 * per_process} ranks" in out), out
    # (a Gloo piece may share a line with the program's output: such a line is kept whole)
    assert sorted(re.findall(r"^\[rank \d\] .*?DEVICES (\d+) (\d+)", out, re.M)) == \
        [(str(2 * per_process), str(per_process))] * 2, out
    assert not re.search(r"^\[rank \d\] \[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of "
                         r"connected peer ranks is : \d+$", out, re.M), out


def test_launcher_passes_gloo_lines_with_verbose(tmp_path):
    rc, out = launch(["-n", "2", "--cpu-devices", "2", "--verbose", _hello(tmp_path)])
    assert rc == 0, out
    assert "[Gloo]" in out, out


def test_launcher_rejects_a_cpu_device_count_below_one(tmp_path):
    rc, out = launch(["-n", "2", "--cpu-devices", "0", _hello(tmp_path)])
    assert rc == 2 and "--cpu-devices must be >= 1" in out, out


def test_reliability_bench_runs_under_the_launcher():
    rc, out = launch(["-n", "2", "--cpu-devices", "2", "-m", "jax_ep.bench.reliability", "--steps", "6",
                      "--cycles", "0", "--tokens", "8", "--hidden", "128"])
    assert rc == 0, out
    assert re.search(r"\[rank 0\] jax_ep.bench.reliability: 4 x cpu", out), out
    assert re.search(r"\[rank 0\] long run: 6 steps x 4 ops .*identical.*final LL state \[12, 0, 0, 0\].*: OK", out), out


def test_a_rank_that_raises_before_its_first_collective_ends_the_job_on_a_loaded_machine():
    """Every core busy with another process: the launcher still stops the others within seconds and names the rank
    (the children set PR_SET_PDEATHSIG themselves: no Python runs between fork and exec in the launcher, which has
    native threads)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        for fail_rank in (0, 1, 0):
            t0 = time.monotonic()
            rc, out = launch(["-n", "3", "--timeout", "100", os.path.join(PROGRAMS, "raise_early.py"),
                              "--fail-rank", str(fail_rank)], timeout=150)
            dt = time.monotonic() - t0
            assert rc == 1, out
            assert f"rank {fail_rank} failed first (exited with code 1)" in out, out
            assert f"RuntimeError: rank {fail_rank} failed before its first collective" in out, out
            assert "psum returned" not in out, out
            assert dt < 60, f"{dt:.1f} s\n{out}"
            print(f"rank {fail_rank} raised: the launcher exited in {dt:.1f} s with every core busy")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
