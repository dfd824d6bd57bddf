"""What the launcher starts: the hosts of the job (flags or SLURM), the coordinator, the GPUs, each child's
environment. Standard library only; no process is started here."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess

from . import env as E


class PlanError(ValueError):
    """A launcher setting that cannot work; the message names the flag (or the variable it came from)."""


@dataclasses.dataclass(frozen=True)
class Hosts:
    num_hosts: int
    host_index: int
    coordinator: str | None  # HOST:PORT; None: one host, coordinator on 127.0.0.1 (port: --port or a free one)
    sources: tuple[str, ...] = ()  # SLURM variables the values came from

    def describe(self) -> str:
        text = f"host {self.host_index} of {self.num_hosts}"
        return text + (f" (from {', '.join(self.sources)})" if self.sources else "")


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list: 'gpu[07-09,12],login1' -> 'gpu07', 'a1,b2' -> 'a1'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    item, out = nodelist[:end].strip(), ""
    while "[" in item:
        head, _, rest = item.partition("[")
        ranges, _, item = rest.partition("]")
        out += head + ranges.split(",")[0].split("-")[0].strip()
    return (out + item) or None


def parse_coordinator(text: str, flag: str = "--coordinator") -> str:
    """Checks HOST:PORT (an IPv6 host in brackets: [::1]:1234); returns it unchanged."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if not sep or not host.strip("[]") or (":" in host and not bracketed):
        raise PlanError(f"{flag} must be HOST:PORT (IPv6 as [ADDR]:PORT), got {text!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise PlanError(f"{flag} port must be in 1..65535, got {text!r}")
    return text


def _slurm_int(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise PlanError(f"{name}={environ[name]!r} is not an integer") from None


def resolve_hosts(num_hosts: int | None, host_index: int | None, coordinator: str | None, port: int | None,
                  environ=None) -> Hosts:
    """The job's hosts from the flags, each flag not given read from SLURM (env.SLURM_*) when set.

    One host (the default): host index 0, coordinator on 127.0.0.1 unless --coordinator. Several hosts: global
    process ids are host_index * n + local_rank; the coordinator is served by process 0, on host index 0, so it
    must be that host's address: --coordinator, else SLURM's first node (SLURM_NODEID 0 is the first node of the
    job's node list; SLURM_LAUNCH_NODE_IPADDR, the node srun ran on, only when there is no node list) with --port
    or the port JAX derives from SLURM_JOB_ID."""
    environ = os.environ if environ is None else environ
    sources = []
    if coordinator is not None and port is not None:
        raise PlanError("--port and --coordinator exclude each other (--coordinator HOST:PORT names the port)")
    if num_hosts is None:
        if environ.get(E.SLURM_NUM_HOSTS):
            num_hosts = _slurm_int(environ, E.SLURM_NUM_HOSTS)
            sources.append(E.SLURM_NUM_HOSTS)
        else:
            num_hosts = 1
    if num_hosts < 1:
        raise PlanError(f"--num-hosts must be >= 1, got {num_hosts}"
                        + (f" (from {E.SLURM_NUM_HOSTS})" if E.SLURM_NUM_HOSTS in sources else ""))
    index_flag = "--host-index"
    if host_index is None:
        if num_hosts == 1:
            host_index = 0
        elif environ.get(E.SLURM_HOST_INDEX):
            host_index = _slurm_int(environ, E.SLURM_HOST_INDEX)
            index_flag = E.SLURM_HOST_INDEX
            sources.append(E.SLURM_HOST_INDEX)
            local = environ.get(E.SLURM_LOCAL_ID)
            if local not in (None, "", "0"):
                raise PlanError(f"{E.SLURM_LOCAL_ID}={local}: more than one launcher on this node; start one per "
                                f"node (srun --ntasks-per-node=1 python -m jax_ep.launch ...) or pass --host-index")
        else:
            hint = (f"; {E.SLURM_NUM_HOSTS}={num_hosts} but {E.SLURM_HOST_INDEX} is not set: start one launcher per "
                    f"node with srun --ntasks-per-node=1, or pass --num-hosts 1" if sources else "")
            raise PlanError(f"--host-index is required with --num-hosts {num_hosts} (this host's index, 0.."
                            f"{num_hosts - 1}; host 0 runs process 0, which serves the coordinator){hint}")
    if not 0 <= host_index < num_hosts:
        raise PlanError(f"{index_flag} must be in 0..{num_hosts - 1} (--num-hosts {num_hosts}), got {host_index}")
    if coordinator is not None:
        coordinator = parse_coordinator(coordinator)
    elif num_hosts > 1:
        host = first_host(environ.get(E.SLURM_NODELIST) or "")
        src = E.SLURM_NODELIST
        if host is None and environ.get(E.SLURM_LAUNCH_NODE):
            host, src = environ[E.SLURM_LAUNCH_NODE].strip(), E.SLURM_LAUNCH_NODE
        if host is None:
            raise PlanError(f"--coordinator HOST:PORT is required with --num-hosts {num_hosts}: the address of host "
                            f"index 0, where process 0 serves jax.distributed's coordinator (the same on every host)")
        sources.append(src)
        if port is None:
            if not environ.get(E.SLURM_JOB_ID):
                raise PlanError(f"--port is required: the coordinator host comes from {src} but {E.SLURM_JOB_ID} "
                                f"is not set to derive a port from (or pass --coordinator HOST:PORT)")
            port = E.slurm_port(_slurm_int(environ, E.SLURM_JOB_ID))
            sources.append(E.SLURM_JOB_ID)
        coordinator = parse_coordinator(f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                                        flag=f"the coordinator from {src}")
    return Hosts(num_hosts, host_index, coordinator, tuple(sources))


def free_port() -> int:
    """A TCP port free on every interface now (the coordinator binds all interfaces on it)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
                    s6.bind(("::", port))
            except OSError as e:
                if e.errno in (98, 48):  # EADDRINUSE on Linux / macOS
                    continue
        return port
    raise RuntimeError("jax_ep.launch: no free port found")


def visible_gpus(environ=None) -> list[str] | None:
    """The GPUs this host may use, as CUDA_VISIBLE_DEVICES entries; None when it has no NVIDIA GPU."""
    environ = os.environ if environ is None else environ
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        out = []
        for e in (e.strip() for e in cvd.split(",")):
            if not e:
                continue
            if e.startswith("-"):  # CUDA stops at the first invalid entry ("-1" hides every GPU)
                break
            out.append(e)
        return out or None  # set but empty (or "-1"): the user hid every GPU, treat as a CPU machine
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            n = sum(1 for line in r.stdout.splitlines() if line.startswith("GPU ")) if r.returncode == 0 else 0
            if n:
                return [str(i) for i in range(n)]
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
        if n:
            return [str(i) for i in range(n)]
    except OSError:
        pass
    return None


def child_envs(nproc: int, hosts: Hosts, coordinator: str, gpus: list[str] | None, gpus_per_process: int,
               settings: dict[str, str], forced: dict[str, str], environ=None,
               processes_per_gpu: int = 1, cpu_devices: int = 1) -> list[dict[str, str]]:
    """One environment per local process: the launcher's own, `forced` (overriding), env.DEFAULT_ENV (unless set;
    env.SHARED_GPU_ENV too without `gpus` or with processes_per_gpu > 1), `settings` and the job variables with
    global process ids, and CUDA_VISIBLE_DEVICES pinning when `gpus` is given: process i gets gpus[i*K:(i+1)*K] (K =
    gpus_per_process), or with processes_per_gpu P > 1 (K = 1) the one GPU gpus[i // P], shared by P consecutive
    processes, each with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // P unless set (NVSHMEM's condition for full
    support of several PEs per GPU: the shares add up to <= 100, so no process can take every SM while another's
    kernel waits for it). JAX_NUM_CPU_DEVICES = cpu_devices unless set: the CPU devices of each process, whatever
    the program's XLA_FLAGS say."""
    base = dict(os.environ if environ is None else environ)
    base.update(forced)
    for k, v in E.DEFAULT_ENV.items():
        base.setdefault(k, v)
    if not gpus or processes_per_gpu > 1:
        for k, v in E.SHARED_GPU_ENV.items():
            base.setdefault(k, v)
    base.update({E.ENV_COORDINATOR: coordinator, E.ENV_NUM_PROCESSES: str(hosts.num_hosts * nproc),
                 E.ENV_LOCAL_SIZE: str(nproc), E.ENV_HOST_INDEX: str(hosts.host_index),
                 E.ENV_NUM_HOSTS: str(hosts.num_hosts)})
    base.update(settings)
    base.setdefault("JAX_NUM_CPU_DEVICES", str(cpu_devices))
    envs = []
    for i in range(nproc):
        env = dict(base)
        env[E.ENV_PROCESS_ID] = str(hosts.host_index * nproc + i)
        env[E.ENV_LOCAL_RANK] = str(i)
        if gpus and processes_per_gpu > 1:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i // processes_per_gpu]
            env.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // processes_per_gpu))
        elif gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * gpus_per_process:(i + 1) * gpus_per_process])
        envs.append(env)
    return envs
