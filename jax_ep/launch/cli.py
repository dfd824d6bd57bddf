"""`python -m jax_ep.launch`: the command line, its checks, and the run (supervisor.Supervisor)."""

from __future__ import annotations

import argparse
import os
import sys

from . import env as E
from .plan import PlanError, child_envs, free_port, resolve_hosts, visible_gpus
from .supervisor import Supervisor, log

_VALUE_OPTIONS = {"-n", "--nproc", "--num-processes", "--gpus-per-process", "--processes-per-gpu", "--grace-seconds", "--timeout",
                  "--port", "--coordinator", "--num-hosts", "--host-index", "--join-timeout", "--heartbeat-timeout",
                  "--cpu-devices"}

USAGE = ("python -m jax_ep.launch -n N [--gpus-per-process K | --processes-per-gpu P] [--no-gpu-pinning] "
         "[--cpu-devices K] [--verbose] "
         "[--num-hosts H --host-index I --coordinator HOST:PORT] [--port PORT] [--join-timeout SECONDS] "
         "[--heartbeat-timeout SECONDS] [--no-join] [--timeout SECONDS] [--grace-seconds SECONDS] (script.py | -m module) [args ...]")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.launch", usage=USAGE,
        description="Start N processes of a JAX program on this host (one GPU each) as part of one jax.distributed "
                    "job, possibly spanning several hosts (one launcher per host); stream their output prefixed "
                    "with '[rank i] ' (i = global process id); if one fails, stop the others here and exit with "
                    "its code. Launcher options come before the script (or -m module); everything after it is "
                    "passed to the program.",
        epilog=f"SLURM: a flag not given is read from {E.SLURM_NUM_HOSTS} (--num-hosts), {E.SLURM_HOST_INDEX} "
               f"(--host-index) and, for several hosts, the first host of {E.SLURM_NODELIST} (else "
               f"{E.SLURM_LAUNCH_NODE}) with --port or a port derived from {E.SLURM_JOB_ID} (--coordinator). "
               f"Start one launcher per node: srun --ntasks-per-node=1 python -m jax_ep.launch -n 8 train.py")
    p.add_argument("-n", "--nproc", "--num-processes", dest="nproc", type=int, required=True,
                   help="processes on THIS host (>= 1; on a GPU machine at most visible GPUs / --gpus-per-process); "
                        "every host must use the same N")
    p.add_argument("--gpus-per-process", type=int, default=1,
                   help="GPUs given to each process through CUDA_VISIBLE_DEVICES (default 1)")
    p.add_argument("--processes-per-gpu", type=int, default=1, metavar="P",
                   help="P consecutive processes share one GPU (testing EP groups larger than the GPUs at hand; "
                        "NVSHMEM then needs the CUDA MPS daemon running, else it refuses team splits and "
                        "barriers); default 1")
    p.add_argument("--no-gpu-pinning", action="store_true",
                   help="do not set CUDA_VISIBLE_DEVICES: every process sees every GPU of the host (to manage "
                        "devices yourself); on a host without GPUs it changes nothing")
    p.add_argument("--cpu-devices", type=int, default=1, metavar="K",
                   help="CPU devices per process (sets JAX_NUM_CPU_DEVICES unless it is set; it overrides a "
                        "--xla_force_host_platform_device_count in the program's XLA_FLAGS); the CPU platform's "
                        "mesh then has N x K devices. Default 1")
    p.add_argument("--verbose", action="store_true",
                   help="pass every line of the children's output through, Gloo's per-device connection lines "
                        "included (dropped by default)")
    p.add_argument("--num-hosts", type=int, default=None, metavar="H",
                   help=f"hosts in the job, one launcher each (default: ${E.SLURM_NUM_HOSTS}, else 1)")
    p.add_argument("--host-index", type=int, default=None, metavar="I",
                   help=f"this host's index, 0..H-1; its processes get global ids I*N .. I*N+N-1 (default: "
                        f"${E.SLURM_HOST_INDEX}; required with H > 1 outside SLURM)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of jax.distributed's coordinator, served by process 0 on host index 0; the same "
                        "on every host (default: 127.0.0.1 and a free port on one host; required with H > 1 "
                        "outside SLURM)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port when --coordinator is not given (one host: on 127.0.0.1, default a free "
                        "one; SLURM: default derived from the job id)")
    p.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"how long each process waits for all processes of the job to connect (default "
                        f"{E.DEFAULT_JOIN_TIMEOUT}); a process that cannot join fails, and the launcher ends the "
                        f"others")
    p.add_argument("--heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"a process silent this long is declared dead and every process of the job is ended "
                        f"(default {E.DEFAULT_HEARTBEAT_TIMEOUT}); the bound on how long a failure on one host "
                        f"takes to end processes on the others that are not in a collective with it")
    p.add_argument("--no-join", action="store_true",
                   help="do not join the job before the program runs: the program calls "
                        "jax_ep.launch.init_from_env() (or jax.distributed.initialize) itself")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help=f"kill every process after this long and exit {E.TIMEOUT_EXIT_CODE}")
    p.add_argument("--grace-seconds", type=float, default=E.DEFAULT_GRACE_SECONDS, metavar="SECONDS",
                   help=f"after SIGTERM, wait this long before SIGKILL (default {E.DEFAULT_GRACE_SECONDS:g})")
    return p


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, command): the command starts at the first non-option word, at `-m`, or after `--`."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], argv[i + 1:]
        if tok == "-m" or (tok.startswith("-m") and not tok.startswith("--")):
            mod = argv[i + 1:] if tok == "-m" else [tok[2:]] + argv[i + 1:]
            return argv[:i], ["-m"] + mod
        if not tok.startswith("-") or tok == "-":
            return argv[:i], argv[i:]
        i += 2 if tok in _VALUE_OPTIONS else 1
    return argv, []


def _check(parser: argparse.ArgumentParser, args, command: list[str]):
    """Every check that needs no process: argparse errors (exit 2) naming the flag. Returns (hosts, gpus)."""
    if args.nproc < 1:
        parser.error(f"-n must be >= 1, got {args.nproc}")
    if args.gpus_per_process < 1:
        parser.error(f"--gpus-per-process must be >= 1, got {args.gpus_per_process}")
    if args.processes_per_gpu < 1:
        parser.error(f"--processes-per-gpu must be >= 1, got {args.processes_per_gpu}")
    if args.processes_per_gpu > 1 and args.gpus_per_process > 1:
        parser.error("--processes-per-gpu and --gpus-per-process > 1 exclude each other: a process shares one GPU "
                     "or owns several")
    if args.cpu_devices < 1:
        parser.error(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
    if args.grace_seconds < 0:
        parser.error(f"--grace-seconds must be >= 0, got {args.grace_seconds:g}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout:g}")
    for flag, value in (("--join-timeout", args.join_timeout), ("--heartbeat-timeout", args.heartbeat_timeout)):
        if value is not None and not value > 0:
            parser.error(f"{flag} must be > 0, got {value:g}")
    if args.port is not None and not (0 < args.port < 65536):
        parser.error(f"--port must be in 1..65535, got {args.port}")
    try:
        hosts = resolve_hosts(args.num_hosts, args.host_index, args.coordinator, args.port)
    except PlanError as e:
        parser.error(str(e))
    if not command:
        parser.error("missing the program to run: give script.py [args...] or -m module [args...] after the "
                     "launcher options")
    if command[0] == "-m" and (len(command) < 2 or not command[1]):
        parser.error("-m needs a module name")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        parser.error(f"script not found: {command[0]}")
    gpus = None if args.no_gpu_pinning else visible_gpus()
    if gpus is not None:
        need = -(-args.nproc // args.processes_per_gpu) * args.gpus_per_process
        if need > len(gpus):
            src = ("CUDA_VISIBLE_DEVICES=" + os.environ["CUDA_VISIBLE_DEVICES"]
                   if "CUDA_VISIBLE_DEVICES" in os.environ else "nvidia-smi")
            parser.error(f"-n {args.nproc} with --gpus-per-process {args.gpus_per_process} and --processes-per-gpu "
                         f"{args.processes_per_gpu} needs {need} GPUs "
                         f"but {len(gpus)} are visible ({src}); lower -n or pass --no-gpu-pinning")
    return hosts, gpus


def main(argv: list[str] | None = None) -> int:
    """Run `python -m jax_ep.launch ARGV`; returns the launcher's exit code (argparse errors: SystemExit(2))."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    opts, command = _split_argv(argv)
    args = parser.parse_args(opts)
    hosts, gpus = _check(parser, args, command)
    from jax_ep.runtime.nvshmem_env import FORCED_ENV  # the one place NVLink multicast is decided

    for k, v in FORCED_ENV.items():
        if os.environ.get(k, v) != v:
            log(f"overriding {k}={os.environ[k]} with {k}={v} (NVLink multicast must stay off)")
    coordinator = hosts.coordinator or f"127.0.0.1:{args.port or free_port()}"
    n = args.nproc
    ranks = [hosts.host_index * n + i for i in range(n)]
    settings = {name: f"{value:g}" for name, value in ((E.ENV_JOIN_TIMEOUT, args.join_timeout),
                                                        (E.ENV_HEARTBEAT_TIMEOUT, args.heartbeat_timeout))
                if value is not None}
    envs = child_envs(n, hosts, coordinator, gpus, args.gpus_per_process, settings, FORCED_ENV,
                      processes_per_gpu=args.processes_per_gpu, cpu_devices=args.cpu_devices)
    first, last = ranks[0], ranks[-1]
    log(f"starting rank{'s' if n > 1 else ''} {first}{f'-{last}' if n > 1 else ''} of {hosts.num_hosts * n}"
        + (f" ({hosts.describe()})" if hosts.num_hosts > 1 else "") + f"; coordinator {coordinator}"
        + ("; the program joins the job itself (--no-join)" if args.no_join else ""))
    log(job_summary(n * hosts.num_hosts, gpus, args.gpus_per_process, args.processes_per_gpu,
                    int(envs[0].get("JAX_NUM_CPU_DEVICES", args.cpu_devices))))
    child = [sys.executable, "-u", "-m", "jax_ep.launch.child"] + (["--no-join"] if args.no_join else [])
    return Supervisor(child + command, ranks, envs, args.grace_seconds, args.timeout, verbose=args.verbose).run()


def job_summary(total: int, gpus: list[str] | None, gpus_per_process: int, processes_per_gpu: int,
                cpu_devices: int) -> str:
    """One line: processes, devices per process and the ranks of an EP axis over every device of the job."""
    if gpus:
        if processes_per_gpu > 1:
            return (f"job: {total} processes, {processes_per_gpu} per GPU (CUDA MPS), 1 GPU device each: an EP axis "
                    f"over every device has {total} ranks")
        return (f"job: {total} processes x {gpus_per_process} GPU{'s' if gpus_per_process > 1 else ''} each: an EP "
                f"axis over every device has {total * gpus_per_process} ranks")
    return (f"job: {total} processes x {cpu_devices} CPU device{'s' if cpu_devices > 1 else ''} each (no GPU "
            f"visible; --cpu-devices): an EP axis over every device has {total * cpu_devices} ranks")
