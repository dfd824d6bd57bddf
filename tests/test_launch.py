"""python -m jax_ep.launch (one process per accelerator, one host) and jax_ep.launch.init_from_env, on CPU.

Several hosts (two launchers forming one job, SLURM variables): tests/test_launch_multihost.py.
Multi-process runs use real processes, jax.distributed over loopback and gloo CPU collectives (the default CPU
collectives implementation on jax 0.10.2). The child programs are in tests/programs/cpu/. Children get a clean
environment: XLA_FLAGS (8 forced devices, set by conftest.py for the in-process tests) is removed and each child
sets its own CPU device count.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jax_ep import launch
from jax_ep.launch import cli, failures, join
from helpers import cpu_child_env  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MP = os.path.join(ROOT, "tests", "programs", "cpu")


def run_launcher(args, timeout=120, cwd=ROOT, **env):
    """Runs `python -m jax_ep.launch ARGS`; returns (returncode, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch"] + list(args), cwd=cwd, env=cpu_child_env(**env),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def show(out, err):
    return f"\n--- stdout ---\n{out}\n--- stderr ---\n{err}"


def rank_lines(text, tag):
    """{rank: [line after the prefix]} for lines `[rank i] TAG...`."""
    got = {}
    for m in re.finditer(rf"^\[rank (\d+)\] ({re.escape(tag)}.*)$", text, re.M):
        got.setdefault(int(m.group(1)), []).append(m.group(2))
    return got


def assert_gone(pids, out):
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # a zombie would still answer kill(0); read its state to tell
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().split(")")[-1].split()[0]
        except OSError:
            continue
        raise AssertionError(f"child process {pid} still exists (state {state}) after the launcher exited{out}")


# ---------------------------------------------------------------------------------------------------------
# (1) topology + cross-process collectives
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nproc,local,no_join", [(2, 2, False), (4, 1, True)])
def test_collectives_across_processes(nproc, local, no_join):
    """The launcher joins the job before the program (whose init_from_env() is then a no-op), or, with --no-join,
    the program's init_from_env() does."""
    rc, out, err, dt = run_launcher(["-n", str(nproc), "--no-gpu-pinning", "--timeout", "100"]
                                    + (["--no-join"] if no_join else [])
                                    + [os.path.join(MP, "collective_check.py"), "--devices-per-process", str(local)])
    assert rc == 0, f"launcher exited {rc} after {dt:.1f} s" + show(out, err)
    G = nproc * local
    want_psum = [float(sum(g + 1 for g in range(G)) * 10 ** j) for j in range(4)]
    want_sum = (G * G) * (G * G - 1) // 2
    for tag, check in [
        ("RESULT topology", lambda r, s: f"process={r}/{nproc} devices={G} local={local}" in s),
        ("RESULT psum", lambda r, s: s == f"RESULT psum process={r} value={want_psum}"),
        ("RESULT all_to_all", lambda r, s: s == f"RESULT all_to_all process={r} rows_ok="
                                                f"{list(range(r * local, (r + 1) * local))}"),
        ("RESULT jit_sum", lambda r, s: s == f"RESULT jit_sum process={r} value={want_sum}"),
        ("RESULT done", lambda r, s: s == f"RESULT done process={r}"),
    ]:
        got = rank_lines(out, tag)
        assert sorted(got) == list(range(nproc)), f"{tag}: lines from ranks {sorted(got)}" + show(out, err)
        for r, lines in got.items():
            assert len(lines) == 1 and check(r, lines[0]), f"rank {r}: {lines}" + show(out, err)
    assert err.count("jax_ep.launch: starting ranks") == 1, show(out, err)
    assert ("the program joins the job itself (--no-join)" in err) == no_join, show(out, err)
    print(f"{nproc} processes x {local} CPU devices: psum/all_to_all/jit sum checked in {dt:.1f} s")


def test_unchanged_script_joins_the_job():
    """A script that never calls init_from_env (nor jax.distributed.initialize) is one process of one job of 2,
    not one of two independent copies; init_from_env() afterwards is a no-op that creates no backend."""
    rc, out, err, dt = run_launcher(["-n", "2", "--no-gpu-pinning", "--timeout", "60",
                                     os.path.join(MP, "no_init.py"), "--devices", "2"], timeout=90)
    assert rc == 0, f"launcher exited {rc} after {dt:.1f} s" + show(out, err)
    for r in range(2):
        assert rank_lines(out, "RESULT joined")[r] == [
            f"RESULT joined process={r}/2 devices=4 JAX_EP_LOCAL_RANK={r} JAX_EP_LOCAL_SIZE=2 JAX_EP_HOST_INDEX=0 "
            f"JAX_EP_NUM_HOSTS=1 CUDA_VISIBLE_DEVICES=None NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0"], show(out, err)
        assert rank_lines(out, "RESULT psum")[r] == [f"RESULT psum process={r} value=10"], show(out, err)
    status = re.findall(r"^jax_ep\.launch: starting ranks 0-1 of 2; coordinator 127\.0\.0\.1:\d+$", err, re.M)
    assert len(status) == 1, "one status line, from the launcher" + show(out, err)


# ---------------------------------------------------------------------------------------------------------
# (2) jax_ep reference backend: multi-process == single process with the same number of devices
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def single_process_ep(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ep") / "single.npz")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, os.path.join(MP, "ep_roundtrip.py"), "--local-devices", "4", "--out", path],
                       cwd=ROOT, env=cpu_child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, "single-process run failed" + show(p.stdout, p.stderr)
    assert "process_model=single-process" in p.stdout, p.stdout
    print(f"single process, 4 devices: {time.monotonic() - t0:.1f} s")
    return dict(np.load(path))


@pytest.mark.parametrize("nproc,local", [(2, 2), (4, 1)])
def test_reference_backend_multiprocess_matches_single_process(nproc, local, single_process_ep, tmp_path):
    path = str(tmp_path / "multi.npz")
    rc, out, err, dt = run_launcher(["-n", str(nproc), "--no-gpu-pinning", "--timeout", "100",
                                     os.path.join(MP, "ep_roundtrip.py"), "--local-devices", str(local),
                                     "--out", path])
    assert rc == 0, f"launcher exited {rc} after {dt:.1f} s" + show(out, err)
    rt = rank_lines(out, "RESULT runtime")
    assert sorted(rt) == list(range(nproc)) and all("process_model=multi-process" in v[0] for v in rt.values()), (
        "every rank must run jax_ep in the multi-process model" + show(out, err))
    assert sorted(rank_lines(out, "RESULT ep_roundtrip")) == list(range(nproc)), show(out, err)
    multi = dict(np.load(path))
    single = single_process_ep
    assert sorted(multi) == sorted(single)
    assert len(multi) >= 15, sorted(multi)
    for k in sorted(single):
        assert multi[k].shape == single[k].shape and multi[k].dtype == single[k].dtype, k
        np.testing.assert_array_equal(multi[k], single[k], err_msg=f"{k}: {nproc} processes x {local} devices "
                                                                   f"differs from 1 process x 4 devices")
    assert int(multi["num_recv_tokens"].sum()) > 0
    print(f"{nproc} x {local}: {len(multi)} outputs bit-identical to the single-process run ({dt:.1f} s)")


# ---------------------------------------------------------------------------------------------------------
# (3) failure propagation
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_rank,how,code", [(1, "exit", 3), (0, "raise", 1), (1, "signal", 128 + 9)])
def test_failing_rank_stops_the_others(fail_rank, how, code):
    """One rank fails while the other blocks in a psum that can never complete: the launcher exits with the
    failed rank's code, quickly, names it, and the blocked rank is gone."""
    rc, out, err, dt = run_launcher(["-n", "2", "--no-gpu-pinning", "--timeout", "60",
                                     os.path.join(MP, "fail_rank.py"), "--fail-rank", str(fail_rank),
                                     "--how", how], timeout=90)
    assert rc == code, f"launcher exit code {rc}, expected {code} ({how} on rank {fail_rank})" + show(out, err)
    assert dt < 20, f"took {dt:.1f} s" + show(out, err)
    assert re.search(rf"rank {fail_rank} failed first \(.*\); exiting with code {code}$", err, re.M), show(out, err)
    other = 1 - fail_rank
    assert re.search(rf"rank {other}: (stopped by the launcher \(SIG(TERM|KILL)\)|exited with code 1)",
                     err), f"rank {other}'s end not reported" + show(out, err)
    assert f"[rank {other}] entering psum that cannot complete" in out, show(out, err)
    assert "psum returned" not in out, show(out, err)
    pids = [int(p) for p in re.findall(r"^\[rank \d\] PID (\d+)$", out, re.M)]
    assert len(pids) == 2, show(out, err)
    assert_gone(pids, show(out, err))
    if how == "raise":
        assert f"[rank {fail_rank}] RuntimeError: deliberate failure on rank {fail_rank}" in err, show(out, err)
    print(f"{how} on rank {fail_rank}: launcher exited {rc} in {dt:.1f} s")


def test_sys_exit_code_propagates_without_jax():
    rc, out, err, dt = run_launcher(["-n", "3", os.path.join(MP, "echo_env.py"), "--exit", "5"])
    assert rc == 5, show(out, err)
    assert re.search(r"rank \d failed first \(exited with code 5\); exiting with code 5", err), show(out, err)


SLOW_EXIT = """import os, sys, time
rank, raised, peer = int(os.environ["JAX_EP_PROCESS_ID"]), sys.argv[1], sys.argv[2]
print("FAILURE_FILE", os.environ.get("JAX_EP_FAILURE_FILE"), flush=True)
if rank == 0:
    def slow_exit(*exc):  # a slow exit after the traceback, like the distributed client's on a loaded machine
        sys.__excepthook__(*exc)
        open(raised, "w").close()
        time.sleep(3)
    sys.excepthook = slow_exit
    raise RuntimeError("rank 0 fails on its own")
while not os.path.exists(raised):  # then rank 1 fails as one that lost its peer would, long before rank 0 exits
    time.sleep(0.01)
if peer == "raise":
    raise ConnectionError("rank 1 lost rank 0")
os._exit(1)
"""


@pytest.mark.parametrize("module,peer", [(False, "raise"), (True, "os_exit")])
def test_the_rank_that_failed_on_its_own_is_named_though_a_peer_dies_first(module, peer, tmp_path):
    """Rank 0 raises and takes 3 s to exit; rank 1 fails once rank 0 has printed its traceback (an exception, or
    os._exit without one) and dies first. The launcher names rank 0 (its bootstrap noted the failure when it
    raised), lets it finish exiting with its own code (a failing rank ignores SIGTERM), and leaves no file in the
    temporary folder; the program does not see the variable of the failure records."""
    (tmp_path / "slow_exit.py").write_text(SLOW_EXIT)
    (tmp_path / "tmp").mkdir()
    program = ["-m", "slow_exit"] if module else [str(tmp_path / "slow_exit.py")]
    rc, out, err, dt = run_launcher(["-n", "2", "--no-join", "--timeout", "60"] + program
                                    + [str(tmp_path / "raised"), peer], cwd=tmp_path, TMPDIR=str(tmp_path / "tmp"))
    assert rc == 1, show(out, err)
    assert "jax_ep.launch: rank 0 failed first (exited with code 1); exiting with code 1" in err, show(out, err)
    assert "rank 0: exited with code 1 while being stopped; rank 1: exited with code 1" in err, show(out, err)
    assert "[rank 0] RuntimeError: rank 0 fails on its own" in err, show(out, err)
    assert sorted(rank_lines(out, "FAILURE_FILE").values()) == [["FAILURE_FILE None"]] * 2, show(out, err)
    assert os.listdir(tmp_path / "tmp") == [], show(out, err)
    assert dt < 20, f"took {dt:.1f} s" + show(out, err)


@pytest.mark.parametrize("noted,deaths,stop_time,first", [
    ({0: (1.0, set())}, {0: 5.0, 1: 2.0}, 2.1, 0),        # rank 0 raised, then took long to die; rank 1 lost it
    ({0: (1.5, {1})}, {0: 3.0, 1: 2.0}, 2.1, 1),          # rank 1 was killed (no record; its death is seen late)
    ({0: (1.0, set()), 1: (0.5, set())}, {0: 3.0, 1: 2.0}, 2.1, 1),  # both failed on their own: the first to note
    ({0: (1.0, {2})}, {0: 3.0, 1: 1.5}, 1.6, 0),          # rank 2 had exited 0 (not failed): rank 0 still counts
    ({0: (2.5, set())}, {0: 3.0, 1: 2.0}, 2.1, 1),        # rank 0 failed after the launcher stopped it
])
def test_first_failure(noted, deaths, stop_time, first):
    assert failures.first_failure(noted, deaths, stop_time) == first


def test_failure_records_name_the_ranks_already_exiting():
    """A rank's record holds when it failed and which local ranks had begun exiting then (here: one reaped)."""
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    with failures.create(3) as f:
        failures.write_pids(f, [os.getpid(), gone, os.getppid()], 3)
        assert failures.read(f, [10, 11, 12]) == {}
        t0 = time.monotonic()
        failures.note(f.fileno(), 0, 3)
        noted = failures.read(f, [10, 11, 12])
    assert list(noted) == [10] and t0 <= noted[10][0] <= time.monotonic() and noted[10][1] == {11}, noted


# ---------------------------------------------------------------------------------------------------------
# (4) --timeout, signals to the launcher, no orphans
# ---------------------------------------------------------------------------------------------------------
def test_timeout_kills_everything():
    """--timeout 8: long enough for both children to start, import JAX, join and print their pid."""
    rc, out, err, dt = run_launcher(["-n", "2", "--timeout", "8", "--grace-seconds", "1",
                                     os.path.join(MP, "echo_env.py"), "--sleep", "300"], timeout=60)
    assert rc == launch.TIMEOUT_EXIT_CODE, f"exit code {rc}" + show(out, err)
    assert 8 <= dt < 25, f"took {dt:.1f} s" + show(out, err)
    assert "timeout: 8 s elapsed with ranks [0, 1] still running" in err, show(out, err)
    assert "timed out after 8 s; exiting with code 124" in err, show(out, err)
    pids = [int(m) for m in re.findall(r'"pid": (\d+)', out)]
    assert len(pids) == 2, show(out, err)
    assert_gone(pids, show(out, err))


def _start_sleeping_launcher(n=2):
    p = subprocess.Popen([sys.executable, "-m", "jax_ep.launch", "-n", str(n), os.path.join(MP, "echo_env.py"),
                          "--sleep", "300"], cwd=ROOT, env=cpu_child_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pids, deadline = [], time.monotonic() + 30
    while len(pids) < n and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        pids += [int(m) for m in re.findall(r'"pid": (\d+)', line)]
    assert len(pids) == n, f"children did not start: {pids}"
    return p, pids


def test_sigint_to_launcher_kills_children():
    p, pids = _start_sleeping_launcher()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGINT, show(out, err)
    assert "received SIGINT; stopping all 2 ranks" in err, show(out, err)
    assert_gone(pids, show(out, err))


def test_launcher_killed_hard_children_die_too():
    """SIGKILL to the launcher cannot be handled: the children die through PR_SET_PDEATHSIG (Linux)."""
    p, pids = _start_sleeping_launcher()
    p.kill()
    p.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            assert_gone(pids, "")
            break
        except AssertionError:
            time.sleep(0.1)
    assert_gone(pids, " (launcher was SIGKILLed)")


# ---------------------------------------------------------------------------------------------------------
# (5) output prefixing, environment, -m
# ---------------------------------------------------------------------------------------------------------
def test_output_prefixed_and_environment():
    rc, out, err, dt = run_launcher(["-n", "3", os.path.join(MP, "echo_env.py"), "a", "--b", "c"],
                                    NCCL_NVLS_ENABLE="1", XLA_PYTHON_CLIENT_PREALLOCATE="true")
    assert rc == 0, show(out, err)
    for r in range(3):
        for j in range(3):
            assert f"[rank {r}] stdout line {j} from rank {r}\n" in out, show(out, err)
            assert f"[rank {r}] stderr line {j} from rank {r}\n" in err, show(out, err)
            assert f"stderr line {j}" not in out and f"stdout line {j}" not in err, show(out, err)
        assert f"[rank {r}] partial line from rank {r}\n" in out, show(out, err)
    for line in out.splitlines():
        assert re.match(r"^\[rank [0-2]\] ", line), f"unprefixed stdout line {line!r}" + show(out, err)
    for line in err.splitlines():
        assert re.match(r"^(\[rank [0-2]\] |jax_ep\.launch: )", line), f"unprefixed stderr line {line!r}"
    envs = {r: json.loads(v[0][4:]) for r, v in rank_lines(out, "ENV ").items()}
    assert sorted(envs) == [0, 1, 2], show(out, err)
    coord = {e["JAX_EP_COORDINATOR"] for e in envs.values()}
    assert len(coord) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coord.pop()), envs
    for r, e in envs.items():
        assert e["JAX_EP_NUM_PROCESSES"] == "3" and e["JAX_EP_PROCESS_ID"] == str(r), e
        assert (e["JAX_EP_LOCAL_RANK"], e["JAX_EP_LOCAL_SIZE"], e["JAX_EP_HOST_INDEX"], e["JAX_EP_NUM_HOSTS"]) == (
            str(r), "3", "0", "1"), e
        assert e["JAX_EP_JOIN_TIMEOUT"] is None and e["joined"] is True, e  # joined before the program ran
        assert e["NVSHMEM_DISABLE_NVLS"] == "1" and e["NCCL_NVLS_ENABLE"] == "0", e  # forced even if set to 1
        assert e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true", e  # the user's value is kept
        assert e["CUDA_VISIBLE_DEVICES"] is None, e  # no GPUs here: nothing pinned
        assert e["argv"] == ["a", "--b", "c"] and e["name"] == "__main__", e
    assert "overriding NCCL_NVLS_ENABLE=1 with NCCL_NVLS_ENABLE=0" in err, err
    assert err.count("jax_ep.launch: starting ranks 0-2 of 3; coordinator 127.0.0.1:") == 1, err


def test_no_join_leaves_joining_to_the_program():
    rc, out, err, dt = run_launcher(["-n", "2", "--no-join", "--join-timeout", "7.5", os.path.join(MP, "echo_env.py")])
    assert rc == 0, show(out, err)
    envs = {r: json.loads(v[0][4:]) for r, v in rank_lines(out, "ENV ").items()}
    assert sorted(envs) == [0, 1] and not any(e["joined"] for e in envs.values()), envs
    assert all(e["JAX_EP_JOIN_TIMEOUT"] == "7.5" for e in envs.values()), envs  # for the program's init_from_env


def test_gpu_pinning_and_module_mode():
    """-m module runs like python -m; CUDA_VISIBLE_DEVICES entries are handed out in order, K per rank; with
    --no-gpu-pinning more processes than GPUs may run, and CUDA_VISIBLE_DEVICES is passed on unchanged."""
    rc, out, err, dt = run_launcher(["-n", "2", "--gpus-per-process", "2", "-m", "echo_env", "x", "-y"], cwd=MP,
                                    CUDA_VISIBLE_DEVICES="3,5,6,7,1")
    assert rc == 0, show(out, err)
    envs = {r: json.loads(v[0][4:]) for r, v in rank_lines(out, "ENV ").items()}
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "3,5" and envs[1]["CUDA_VISIBLE_DEVICES"] == "6,7", envs
    assert envs[0]["argv"] == ["x", "-y"] and envs[0]["name"] == "__main__", envs
    assert envs[0]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false", envs  # default when unset
    rc, out, err, dt = run_launcher(["-n", "2", "--no-gpu-pinning", "-m", "echo_env"], cwd=MP,
                                    CUDA_VISIBLE_DEVICES="3")
    envs = {r: json.loads(v[0][4:]) for r, v in rank_lines(out, "ENV ").items()}
    assert rc == 0 and envs[0]["CUDA_VISIBLE_DEVICES"] == envs[1]["CUDA_VISIBLE_DEVICES"] == "3", show(out, err)


@pytest.mark.parametrize("argv,env,message", [
    (["-n", "0", "x.py"], {}, "-n must be >= 1, got 0"),
    (["-n", "two", "x.py"], {}, "argument -n/--nproc/--num-processes: invalid int value: 'two'"),
    (["x.py"], {}, "the following arguments are required: -n"),
    (["-n", "2"], {}, "missing the program to run"),
    (["-n", "2", "-m"], {}, "-m needs a module name"),
    (["-n", "2", "does_not_exist.py"], {}, "script not found: does_not_exist.py"),
    (["-n", "3", "tests/test_launch.py"], {"CUDA_VISIBLE_DEVICES": "0,1"},
     "-n 3 with --gpus-per-process 1 and --processes-per-gpu 1 needs 3 GPUs but 2 are visible "
     "(CUDA_VISIBLE_DEVICES=0,1)"),
    (["-n", "5", "--processes-per-gpu", "2", "tests/test_launch.py"], {"CUDA_VISIBLE_DEVICES": "0,1"},
     "needs 3 GPUs but 2 are visible"),
    (["-n", "2", "--processes-per-gpu", "0", "tests/test_launch.py"], {}, "--processes-per-gpu must be >= 1"),
    (["-n", "2", "--processes-per-gpu", "2", "--gpus-per-process", "2", "tests/test_launch.py"], {},
     "--processes-per-gpu and --gpus-per-process > 1 exclude each other"),
    (["-n", "2", "--gpus-per-process", "2", "tests/test_launch.py"], {"CUDA_VISIBLE_DEVICES": "0,1,2"},
     "needs 4 GPUs but 3 are visible"),
    (["-n", "2", "--gpus-per-process", "0", "tests/test_launch.py"], {}, "--gpus-per-process must be >= 1"),
    (["-n", "2", "--timeout", "0", "tests/test_launch.py"], {}, "--timeout must be > 0"),
    (["-n", "2", "--bogus", "tests/test_launch.py"], {}, "unrecognized arguments: --bogus"),
    (["-n", "2", "--join-timeout", "-1", "tests/test_launch.py"], {}, "--join-timeout must be > 0, got -1"),
    (["-n", "2", "--port", "70000", "tests/test_launch.py"], {}, "--port must be in 1..65535, got 70000"),
])
def test_argument_errors(argv, env, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert message in err and "usage: python -m jax_ep.launch" in err, err


def test_split_argv():
    s = cli._split_argv
    assert s(["-n", "2", "a.py", "-n", "3"]) == (["-n", "2"], ["a.py", "-n", "3"])
    assert s(["-n", "2", "--timeout=5", "-m", "pkg.mod", "--x"]) == (["-n", "2", "--timeout=5"],
                                                                      ["-m", "pkg.mod", "--x"])
    assert s(["-n2", "--no-gpu-pinning", "--", "-weird.py"]) == (["-n2", "--no-gpu-pinning"], ["-weird.py"])
    assert s(["-n", "2", "-mpkg"]) == (["-n", "2"], ["-m", "pkg"])
    assert s(["-n", "1", "--num-hosts", "2", "--host-index", "1", "--coordinator", "h:1", "--join-timeout", "5",
              "--no-join", "t.py", "--host-index", "0"]) == (
        ["-n", "1", "--num-hosts", "2", "--host-index", "1", "--coordinator", "h:1", "--join-timeout", "5",
         "--no-join"], ["t.py", "--host-index", "0"])


# ---------------------------------------------------------------------------------------------------------
# the child bootstrap on its own
# ---------------------------------------------------------------------------------------------------------
PROG = """import atexit, sys
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:], __name__, sys.path[0] == __file__.rsplit("/", 1)[0], flush=True)
def fail(mode):
    if mode == "raise":
        raise ValueError("boom")
    if mode == "exit":
        sys.exit(7)
    if mode == "message":
        sys.exit("bad thing")
fail(sys.argv[1])
"""


@pytest.mark.parametrize("mode,code", [("ok", 0), ("raise", 1), ("exit", 7), ("message", 1)])
def test_child_bootstrap_runs_like_python(mode, code, tmp_path):
    """python -m jax_ep.launch.child runs a script like python would (argv, __main__, sys.path[0]); on failure it
    prints the traceback without its own or runpy's frames and exits at once with the code, skipping atexit."""
    script = tmp_path / "prog.py"
    script.write_text(PROG)
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch.child", str(script), mode, "--x"], cwd=ROOT,
                       env=cpu_child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == code, show(p.stdout, p.stderr)
    assert f"argv ['{mode}', '--x'] __main__ True" in p.stdout, show(p.stdout, p.stderr)
    assert ("atexit ran" in p.stdout) == (code == 0), show(p.stdout, p.stderr)
    if mode == "raise":
        tb = p.stderr
        assert tb.startswith("Traceback (most recent call last):") and "ValueError: boom" in tb, tb
        assert f'File "{script}", line 11, in <module>' in tb and "in fail" in tb, tb
        assert "jax_ep/launch/child.py" not in tb and "runpy" not in tb, tb
    if mode == "message":
        assert p.stderr.strip() == "bad thing", show(p.stdout, p.stderr)


def test_child_bootstrap_usage():
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch.child", "--no-join", "-m"], cwd=ROOT, env=cpu_child_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "usage: python -m jax_ep.launch.child" in p.stderr, show(p.stdout, p.stderr)


# ---------------------------------------------------------------------------------------------------------
# init_from_env in this process (no launcher)
# ---------------------------------------------------------------------------------------------------------
def test_init_from_env_without_launcher(monkeypatch):
    import jax
    for k in (launch.ENV_COORDINATOR, launch.ENV_NUM_PROCESSES, launch.ENV_PROCESS_ID):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(join, "_state", None)
    assert launch.init_from_env() == (0, 1)
    assert launch.init_from_env() == (0, 1)
    assert not jax.distributed.is_initialized()


def test_init_from_env_partial_environment(monkeypatch):
    monkeypatch.setattr(join, "_state", None)
    monkeypatch.setenv(launch.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.delenv(launch.ENV_NUM_PROCESSES, raising=False)
    monkeypatch.setenv(launch.ENV_PROCESS_ID, "0")
    with pytest.raises(RuntimeError, match="JAX_EP_NUM_PROCESSES not"):
        launch.init_from_env()
    monkeypatch.setenv(launch.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(launch.ENV_PROCESS_ID, "2")
    with pytest.raises(RuntimeError, match=r"JAX_EP_PROCESS_ID=2 not in \[0, JAX_EP_NUM_PROCESSES=2\)"):
        launch.init_from_env()
    assert join._state is None


# ---------------------------------------------------------------------------------------------------------
# (5) a stalled (alive) peer: bounded by EPConfig.timeout_seconds, not a hang
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["dispatch", "low_latency_dispatch"])
def test_stalled_peer_is_an_error_naming_op_and_rank(op):
    """Rank 1 sleeps after one step (still heartbeating, so the coordination service sees nothing wrong); rank 0's
    next reference-backend op must fail within timeout_seconds (5 s) plus slack with an EPError naming the op and
    rank 1, and the launcher must then end rank 1 (which would otherwise sleep 300 s)."""
    rc, out, err, dt = run_launcher(["-n", "2", "--no-gpu-pinning", "--timeout", "90", "--grace-seconds", "2",
                                     os.path.join(MP, "stall_rank.py"), "--stall-rank", "1", "--timeout", "5",
                                     "--op", op], timeout=120)
    assert rc == 7, f"launcher exit code {rc}, expected 7 (rank 0's arrival error)" + show(out, err)
    m = re.search(r"^\[rank 0\] ARRIVAL_ERROR ([\d.]+) (.*)$", out, re.M)
    assert m, "rank 0 printed no arrival error" + show(out, err)
    waited, message = float(m.group(1)), m.group(2)
    assert 4.5 <= waited <= 5 + 5, f"rank 0 waited {waited} s for a 5 s timeout" + show(out, err)
    assert message.startswith(f"EPError: jax_ep.{op}"), message
    assert "process 1 (ranks [1] on axis 'ep') did not arrive" in message, message
    assert "within 5 s" in message, message
    assert "STEP 2 returned" not in out, show(out, err)
    assert re.search(r"rank 1: stopped by the launcher \(SIG(TERM|KILL)\)", err), show(out, err)
    assert dt < 60, f"launcher took {dt:.1f} s" + show(out, err)
    print(f"{op}: rank 0 raised after {waited:.1f} s: {message}")
