"""Launcher for the one-process-per-GPU model, on one host or several, and the child-side `init_from_env()`.

    python -m jax_ep.launch -n N [options] script.py [args...]
    python -m jax_ep.launch -n N [options] -m package.module [args...]
    python -m jax_ep.launch -n N --num-hosts H --host-index I --coordinator HOST:PORT script.py   # on each host

starts N processes of the program on this host (local rank i gets one GPU of the visible ones through
CUDA_VISIBLE_DEVICES and the global process id I*N + i) and joins them, with the other hosts' processes, into one
jax.distributed job before the program runs, so an unchanged JAX script runs as one job of H*N processes. Their
output is streamed prefixed with `[rank <global id>] `; when a rank exits non-zero or is killed, the others on
this host are terminated (SIGTERM, then SIGKILL after --grace-seconds) and the launcher names the rank that failed
first and exits with its code. Under SLURM, --num-hosts, --host-index and --coordinator default to what
SLURM_JOB_NUM_NODES, SLURM_NODEID and SLURM_JOB_NODELIST say (jax_ep/launch/plan.py: resolve_hosts).

Modules: env (variable names, defaults), plan (hosts, coordinator, GPUs, child environments), supervisor
(processes, output, failure propagation), failures (which rank failed first), cli (the command line), child (the
bootstrap each process runs: join, then the program), join (`init_from_env`). The launcher process imports no JAX
from here; docs: docs/PROCESS_MODELS.md.
"""

from .env import (ENV_COORDINATOR, ENV_HEARTBEAT_TIMEOUT, ENV_HOST_INDEX, ENV_JOIN_TIMEOUT, ENV_LOCAL_RANK,
                  ENV_LOCAL_SIZE, ENV_NUM_HOSTS, ENV_NUM_PROCESSES, ENV_PROCESS_ID, TIMEOUT_EXIT_CODE)
from .join import init_from_env
from .cli import main

__all__ = ["init_from_env", "main", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_LOCAL_RANK",
           "ENV_LOCAL_SIZE", "ENV_HOST_INDEX", "ENV_NUM_HOSTS", "ENV_JOIN_TIMEOUT", "ENV_HEARTBEAT_TIMEOUT",
           "TIMEOUT_EXIT_CODE"]
