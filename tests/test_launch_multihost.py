"""python -m jax_ep.launch across several hosts, simulated on this one (CPU): two launchers, one per "host", each
with -n 1 and its own CUDA_VISIBLE_DEVICES, form one jax.distributed job of 2 processes; a failure on one host
ends the job on the other; a missing host ends in an error, not a hang. Plus the host/coordinator resolution
from flags and SLURM variables, and the argument errors (in process, no JAX).

Every launcher runs with --timeout and every wait here has a timeout: nothing can hang.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from jax_ep import launch
from jax_ep.launch import env as E
from jax_ep.launch.plan import Hosts, PlanError, child_envs, first_host, free_port, resolve_hosts
from helpers import cpu_child_env  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MP = os.path.join(ROOT, "tests", "programs", "cpu")


def child_env(**extra):
    return cpu_child_env(drop_slurm=True, **extra)


def show(outs):
    return "".join(f"\n--- host {h} stdout ---\n{o}\n--- host {h} stderr ---\n{e}" for h, (o, e) in enumerate(outs))


def run_hosts(program, *, port, extra=(), env_per_host=None, hosts=2, timeout=60):
    """Starts one launcher per simulated host (-n 1 --num-hosts H --host-index i --coordinator 127.0.0.1:PORT),
    the last host first (the job must wait for host 0's coordinator); returns ([rc], [(stdout, stderr)], seconds).
    The launchers run with --timeout (timeout - 15) and are killed if still running after `timeout`."""
    procs = {}
    t0 = time.monotonic()
    try:
        for h in reversed(range(hosts)):
            env = child_env(**(env_per_host[h] if env_per_host else {}))
            procs[h] = subprocess.Popen(
                [sys.executable, "-m", "jax_ep.launch", "-n", "1", "--num-hosts", str(hosts), "--host-index", str(h),
                 "--coordinator", f"127.0.0.1:{port}", "--timeout", str(timeout - 15), "--join-timeout", "20",
                 *extra, *program], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)
        outs = {}
        for h in range(hosts):  # output is small: reading one launcher fully while the other runs cannot block it
            outs[h] = procs[h].communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        return [procs[h].returncode for h in range(hosts)], [outs[h] for h in range(hosts)], time.monotonic() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)


def test_two_launchers_form_one_job():
    """Host 0 and host 1, one process each, pinned to "GPU" 0 and 1 through their own CUDA_VISIBLE_DEVICES: one
    job of 2 processes (global ids 0 and 1, 2 CPU devices each), joined before an unchanged script runs; a psum
    over all 4 devices sees both hosts."""
    port = free_port()
    rcs, outs, dt = run_hosts([os.path.join(MP, "no_init.py"), "--devices", "2"], port=port,
                              env_per_host=[{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}])
    assert rcs == [0, 0], f"launchers exited {rcs} after {dt:.1f} s" + show(outs)
    for h, (out, err) in enumerate(outs):
        assert re.search(rf"^\[rank {h}\] RESULT joined process={h}/2 devices=4 JAX_EP_LOCAL_RANK=0 "
                         rf"JAX_EP_LOCAL_SIZE=1 JAX_EP_HOST_INDEX={h} JAX_EP_NUM_HOSTS=2 CUDA_VISIBLE_DEVICES={h} "
                         rf"NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0$", out, re.M), show(outs)
        assert re.search(rf"^\[rank {h}\] RESULT psum process={h} value=10$", out, re.M), show(outs)
        assert not re.search(rf"^\[rank {1 - h}\]", out + err, re.M), "a launcher shows only its own ranks"
        status = f"jax_ep.launch: starting rank {h} of 2 (host {h} of 2); coordinator 127.0.0.1:{port}"
        assert err.count("jax_ep.launch: starting") == 1 and status in err, show(outs)
    assert dt < 40, f"took {dt:.1f} s" + show(outs)
    print(f"two launchers, one job of 2 processes: {dt:.1f} s")


@pytest.mark.parametrize("fail_host,how,code", [(1, "exit", 3), (0, "signal", 128 + 9)])
def test_failure_on_one_host_ends_the_other(fail_host, how, code):
    """The failing host's launcher exits with its rank's code; the other host's rank, blocked in a psum with the
    dead one, fails at once (also when the dead one served the coordinator) and its launcher exits non-zero."""
    rcs, outs, dt = run_hosts([os.path.join(MP, "fail_rank.py"), "--fail-rank", str(fail_host), "--how", how],
                              port=free_port())
    ok = 1 - fail_host
    assert rcs[fail_host] == code, f"launchers exited {rcs}" + show(outs)
    assert rcs[ok] != 0 and rcs[ok] != E.TIMEOUT_EXIT_CODE, f"launchers exited {rcs}" + show(outs)
    assert f"rank {fail_host} failed first" in outs[fail_host][1], show(outs)
    assert f"[rank {ok}] entering psum that cannot complete" in outs[ok][0], show(outs)
    assert re.search(rf"jax_ep\.launch: rank {ok} failed first \((exited with code|was killed by)", outs[ok][1]), \
        show(outs)
    assert dt < 40, f"took {dt:.1f} s" + show(outs)


def test_failure_reaches_an_idle_host_within_the_heartbeat_timeout():
    """A rank that is not in a collective with the failed one learns of the failure from jax.distributed's
    heartbeats: within --heartbeat-timeout, its process is ended and its launcher exits non-zero."""
    rcs, outs, dt = run_hosts([os.path.join(MP, "fail_rank.py"), "--fail-rank", "1", "--how", "exit",
                               "--no-collective"], port=free_port(), extra=["--heartbeat-timeout", "3"])
    assert rcs[1] == 3, f"launchers exited {rcs}" + show(outs)
    assert rcs[0] not in (0, E.TIMEOUT_EXIT_CODE), f"launchers exited {rcs} after {dt:.1f} s" + show(outs)
    assert "rank 0 failed first" in outs[0][1], show(outs)
    assert dt < 40, f"took {dt:.1f} s" + show(outs)


@pytest.mark.parametrize("host", [0, 1])
def test_missing_host_is_an_error_not_a_hang(host):
    """Only one of two hosts starts: its process gives up after --join-timeout and the launcher exits non-zero."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "1", "--num-hosts", "2", "--host-index",
                        str(host), "--coordinator", f"127.0.0.1:{free_port()}", "--join-timeout", "3", "--timeout",
                        "40", os.path.join(MP, "no_init.py")], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=60)
    dt = time.monotonic() - t0
    assert p.returncode not in (0, E.TIMEOUT_EXIT_CODE), show([(p.stdout, p.stderr)])
    assert f"rank {host} failed first" in p.stderr and "RegisterTask" in p.stderr, show([(p.stdout, p.stderr)])
    assert "RESULT joined" not in p.stdout and dt < 30, show([(p.stdout, p.stderr)])


# ---------------------------------------------------------------------------------------------------------
# hosts and coordinator from flags and SLURM (no processes)
# ---------------------------------------------------------------------------------------------------------
SLURM = {"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
         "SLURM_JOB_ID": "123456", "SLURM_LOCALID": "0", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}
SLURM_PORT = 61440 + 123456 % 4096  # JAX's rule for SLURM jobs


@pytest.mark.parametrize("flags,environ,want", [
    ((None, None, None, None), {}, Hosts(1, 0, None)),
    ((None, None, None, 5000), {}, Hosts(1, 0, None)),
    ((1, 0, "h:80", None), {}, Hosts(1, 0, "h:80")),
    ((2, 1, "10.0.0.1:1234", None), {}, Hosts(2, 1, "10.0.0.1:1234")),
    ((2, 0, "[::1]:1234", None), {}, Hosts(2, 0, "[::1]:1234")),
    ((None, None, None, None), SLURM,
     Hosts(4, 2, f"gpu07:{SLURM_PORT}", ("SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID"))),
    ((None, None, None, 7777), SLURM,
     Hosts(4, 2, "gpu07:7777", ("SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST"))),
    ((None, None, None, None), {**SLURM, "SLURM_JOB_NODELIST": ""},
     Hosts(4, 2, f"10.1.2.3:{SLURM_PORT}",
           ("SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_JOB_ID"))),
    ((None, 3, "c:9", None), SLURM, Hosts(4, 3, "c:9", ("SLURM_JOB_NUM_NODES",))),
    ((2, 0, "c:9", None), SLURM, Hosts(2, 0, "c:9")),
    ((1, None, None, None), {**SLURM, "SLURM_NODEID": "3"}, Hosts(1, 0, None)),  # one host in a bigger allocation
    ((None, None, None, None), {**SLURM, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"},
     Hosts(1, 0, None, ("SLURM_JOB_NUM_NODES",))),
])
def test_resolve_hosts(flags, environ, want):
    assert resolve_hosts(*flags, environ=environ) == want


@pytest.mark.parametrize("flags,environ,message", [
    ((0, None, None, None), {}, "--num-hosts must be >= 1, got 0"),
    ((2, None, "h:1", None), {}, "--host-index is required with --num-hosts 2"),
    ((2, 2, "h:1", None), {}, "--host-index must be in 0..1 (--num-hosts 2), got 2"),
    ((1, 1, None, None), {}, "--host-index must be in 0..0 (--num-hosts 1), got 1"),
    ((2, 0, None, None), {}, "--coordinator HOST:PORT is required with --num-hosts 2"),
    ((2, 0, "nohost", None), {}, "--coordinator must be HOST:PORT (IPv6 as [ADDR]:PORT), got 'nohost'"),
    ((2, 0, ":80", None), {}, "--coordinator must be HOST:PORT"),
    ((2, 0, "::1:80", None), {}, "--coordinator must be HOST:PORT (IPv6 as [ADDR]:PORT)"),
    ((2, 0, "h:0", None), {}, "--coordinator port must be in 1..65535, got 'h:0'"),
    ((2, 0, "h:x", None), {}, "--coordinator port must be in 1..65535"),
    ((2, 0, "h:1", 5), {}, "--port and --coordinator exclude each other"),
    ((None, None, None, None), {**SLURM, "SLURM_NODEID": "4"}, "SLURM_NODEID must be in 0..3 (--num-hosts 4), got 4"),
    ((None, None, None, None), {**SLURM, "SLURM_LOCALID": "1"}, "SLURM_LOCALID=1: more than one launcher on this"),
    ((None, None, None, None), {**SLURM, "SLURM_JOB_ID": ""}, "--port is required: the coordinator host comes "
                                                               "from SLURM_JOB_NODELIST"),
    ((None, None, None, None), {**SLURM, "SLURM_JOB_NUM_NODES": "x"}, "SLURM_JOB_NUM_NODES='x' is not an integer"),
    ((None, None, None, None), {**SLURM, "SLURM_JOB_NUM_NODES": "0"},
     "--num-hosts must be >= 1, got 0 (from SLURM_JOB_NUM_NODES)"),
    ((None, None, None, None), {"SLURM_JOB_NUM_NODES": "2"}, "--host-index is required with --num-hosts 2 (this "
     "host's index, 0..1; host 0 runs process 0, which serves the coordinator); SLURM_JOB_NUM_NODES=2 but "
     "SLURM_NODEID is not set: start one launcher per node with srun --ntasks-per-node=1, or pass --num-hosts 1"),
    ((None, None, None, None), {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1"},
     "--coordinator HOST:PORT is required with --num-hosts 2"),
])
def test_resolve_hosts_errors(flags, environ, message):
    with pytest.raises(PlanError) as e:
        resolve_hosts(*flags, environ=environ)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("nodelist,want", [("gpu[07-09,12],login1", "gpu07"), ("a1,b2", "a1"), ("node001", "node001"),
                                           ("n[1-2]x[3-4],m", "n1x3"), ("h-[0010-0020]", "h-0010"), ("", None)])
def test_first_host(nodelist, want):
    assert first_host(nodelist) == want


def test_child_envs_global_ids_and_pinning():
    hosts = Hosts(3, 1, "c:9")
    envs = child_envs(2, hosts, "c:9", ["4", "5", "6", "7"], 2, {E.ENV_HEARTBEAT_TIMEOUT: "7"},
                      {"NCCL_NVLS_ENABLE": "0"}, environ={"NCCL_NVLS_ENABLE": "1", "PYTHONUNBUFFERED": "0", "X": "y"})
    got = [(e[E.ENV_PROCESS_ID], e[E.ENV_LOCAL_RANK], e["CUDA_VISIBLE_DEVICES"]) for e in envs]
    assert got == [("2", "0", "4,5"), ("3", "1", "6,7")], got
    for e in envs:
        assert (e[E.ENV_COORDINATOR], e[E.ENV_NUM_PROCESSES], e[E.ENV_LOCAL_SIZE], e[E.ENV_HOST_INDEX],
                e[E.ENV_NUM_HOSTS]) == ("c:9", "6", "2", "1", "3"), e
        assert e["NCCL_NVLS_ENABLE"] == "0" and e["PYTHONUNBUFFERED"] == "0" and e["X"] == "y", e
        # GPUs of its own: XLA's preallocation stays at its default (on), the pool peers map for direct receive
        assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in e and e[E.ENV_HEARTBEAT_TIMEOUT] == "7", e


def test_child_envs_preallocation_off_only_where_processes_share_gpus():
    hosts = Hosts(1, 0, "c:9")
    shared = child_envs(2, hosts, "c:9", ["0"], 1, {}, {}, environ={}, processes_per_gpu=2)
    unpinned = child_envs(2, hosts, "c:9", None, 1, {}, {}, environ={})
    own = child_envs(2, hosts, "c:9", ["0", "1"], 1, {}, {}, environ={})
    kept = child_envs(2, hosts, "c:9", ["0"], 1, {}, {}, environ={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
                      processes_per_gpu=2)
    assert [e["XLA_PYTHON_CLIENT_PREALLOCATE"] for e in shared + unpinned] == ["false"] * 4
    assert ["XLA_PYTHON_CLIENT_PREALLOCATE" in e for e in own] == [False, False]
    assert [e["XLA_PYTHON_CLIENT_PREALLOCATE"] for e in kept] == ["true", "true"]  # the user's setting wins


def test_child_envs_processes_per_gpu():
    """--processes-per-gpu P: consecutive processes share GPU i // P (several NVSHMEM PEs per GPU)."""
    envs = child_envs(5, Hosts(1, 0, "c:9"), "c:9", ["2", "3", "6"], 1, {}, {}, environ={}, processes_per_gpu=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "2", "3", "3", "6"]
    assert [e[E.ENV_LOCAL_RANK] for e in envs] == ["0", "1", "2", "3", "4"]
    assert {e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in envs} == {"50"}  # shares of one GPU add up to <= 100
    kept = child_envs(2, Hosts(1, 0, "c:9"), "c:9", ["0"], 1, {}, {}, environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"},
                      processes_per_gpu=2)
    assert [e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for e in kept] == ["30", "30"]


@pytest.mark.parametrize("argv,environ,message", [
    (["-n", "1", "--num-hosts", "2", "x.py"], {}, "--host-index is required with --num-hosts 2"),
    (["-n", "1", "--num-hosts", "2", "--host-index", "0", "x.py"], {}, "--coordinator HOST:PORT is required"),
    (["-n", "1", "--num-hosts", "2", "--host-index", "1", "--coordinator", "h", "x.py"], {},
     "--coordinator must be HOST:PORT"),
    (["-n", "1", "--host-index", "1", "x.py"], {}, "--host-index must be in 0..0 (--num-hosts 1), got 1"),
    (["-n", "1", "--num-hosts", "two", "x.py"], {}, "argument --num-hosts: invalid int value: 'two'"),
    (["-n", "1", "--heartbeat-timeout", "0", "x.py"], {}, "--heartbeat-timeout must be > 0, got 0"),
    (["-n", "1", "x.py"], {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "2"},
     "SLURM_NODEID must be in 0..1 (--num-hosts 2), got 2"),
])
def test_multihost_argument_errors(argv, environ, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "usage: python -m jax_ep.launch" in err, err
