"""The environment of a launched job: variable names, defaults and the SLURM variables the launcher reads.

Leaf module (standard library only): imported by the launcher process, by the child bootstrap before JAX, and by
`init_from_env` in the user's program.
"""

from __future__ import annotations

# Set by the launcher in every child; read by `init_from_env` / the child bootstrap to join the job.
ENV_COORDINATOR = "JAX_EP_COORDINATOR"      # HOST:PORT of jax.distributed's coordinator (served by process 0)
ENV_NUM_PROCESSES = "JAX_EP_NUM_PROCESSES"  # processes in the whole job (every host)
ENV_PROCESS_ID = "JAX_EP_PROCESS_ID"        # global process id: host_index * local_size + local_rank
JOB_VARIABLES = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)

# The launcher's pid: the child bootstrap asks for SIGKILL when that process dies (PR_SET_PDEATHSIG), and exits at
# once if it is already gone.
ENV_LAUNCHER_PID = "JAX_EP_LAUNCHER_PID"
# FD:I:N: the descriptor of the launcher's file where the child bootstrap of local rank I of N notes when its program
# failed (failures.py); the bootstrap removes the variable from the program's environment.
ENV_FAILURE_FILE = "JAX_EP_FAILURE_FILE"
# Informational (the launcher sets them; nothing requires them): where this process sits.
ENV_LOCAL_RANK = "JAX_EP_LOCAL_RANK"        # 0 .. local_size-1 on this host
ENV_LOCAL_SIZE = "JAX_EP_LOCAL_SIZE"        # processes on this host (-n)
ENV_HOST_INDEX = "JAX_EP_HOST_INDEX"        # this host's index, 0 .. num_hosts-1
ENV_NUM_HOSTS = "JAX_EP_NUM_HOSTS"          # hosts in the job
# Seconds jax.distributed.initialize waits for every process to connect (its `initialization_timeout`).
ENV_JOIN_TIMEOUT = "JAX_EP_JOIN_TIMEOUT"
# Seconds without a heartbeat after which the coordination service declares a process dead and ends every other
# process of the job (jax.distributed.initialize's `heartbeat_timeout_seconds`): how a failure reaches the
# processes of other hosts that are not blocked in a collective with the failed one.
ENV_HEARTBEAT_TIMEOUT = "JAX_EP_HEARTBEAT_TIMEOUT"

# Set in every child unless the user set them.
DEFAULT_ENV = {"PYTHONUNBUFFERED": "1"}  # output streams through the launcher as it comes
# Also set unless the user set them where processes share GPUs (several per GPU, or no GPU pinning), whose memory XLA's
# preallocation (75% of every visible GPU) would take several times over. With GPUs of its own each process keeps
# XLA's default, preallocation on: that pool is what the peers map for direct receive (jax_ep/runtime/receive_pools.py).
SHARED_GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
# NVLink multicast off in every child: decided in jax_ep.runtime.nvshmem_env.FORCED_ENV (imported where used).

TIMEOUT_EXIT_CODE = 124
DEFAULT_GRACE_SECONDS = 10.0
DEFAULT_JOIN_TIMEOUT = 300  # jax.distributed.initialize's own defaults
DEFAULT_HEARTBEAT_TIMEOUT = 100
LOG_PREFIX = "jax_ep.launch: "

# SLURM variables read by the launcher when the matching flag is not given (one launcher per node, e.g.
# `srun --ntasks-per-node=1 python -m jax_ep.launch -n 8 train.py`).
SLURM_NUM_HOSTS = "SLURM_JOB_NUM_NODES"      # -> --num-hosts
SLURM_HOST_INDEX = "SLURM_NODEID"            # -> --host-index
SLURM_NODELIST = "SLURM_JOB_NODELIST"        # its first host -> the host part of --coordinator
SLURM_LAUNCH_NODE = "SLURM_LAUNCH_NODE_IPADDR"  # host part of --coordinator when the node list is absent
SLURM_JOB_ID = "SLURM_JOB_ID"                # -> the port of --coordinator when --port is not given
SLURM_LOCAL_ID = "SLURM_LOCALID"             # must be 0: one launcher per node
SLURM_VARIABLES = (SLURM_NUM_HOSTS, SLURM_HOST_INDEX, SLURM_NODELIST, SLURM_LAUNCH_NODE, SLURM_JOB_ID,
                   SLURM_LOCAL_ID)


def slurm_port(job_id: int) -> int:
    """The coordinator port of a SLURM job: JAX's own rule (a port in [61440, 65535] from the job id), so every
    node computes the same one without talking to the others."""
    return 65536 - 4096 + int(job_id) % 4096
