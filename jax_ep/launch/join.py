"""Joining the job the launcher started: `init_from_env`, used by the child bootstrap and by user programs.

Imports JAX only inside `init_from_env`, after the launcher's environment is in place.
"""

from __future__ import annotations

import os
import threading
import warnings

from .env import (ENV_COORDINATOR, ENV_HEARTBEAT_TIMEOUT, ENV_JOIN_TIMEOUT, ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                  JOB_VARIABLES)

_state: tuple[int, int] | None = None
_lock = threading.Lock()


def job_from_env(environ=None) -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) from the launcher's variables; None when none is set.
    Raises RuntimeError when only some are set or the values do not make sense."""
    environ = os.environ if environ is None else environ
    values = {k: environ.get(k) for k in JOB_VARIABLES}
    present = [k for k, v in values.items() if v]
    if not present:
        return None
    if len(present) != len(JOB_VARIABLES):
        missing = [k for k in JOB_VARIABLES if k not in present]
        raise RuntimeError(f"jax_ep.launch.init_from_env: {', '.join(present)} set but {', '.join(missing)} "
                           f"not; set all three (python -m jax_ep.launch does) or none")
    try:
        num_processes = int(values[ENV_NUM_PROCESSES])
        process_id = int(values[ENV_PROCESS_ID])
    except ValueError as e:
        raise RuntimeError(f"jax_ep.launch.init_from_env: bad {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}: {e}") from None
    if not (num_processes >= 1 and 0 <= process_id < num_processes):
        raise RuntimeError(f"jax_ep.launch.init_from_env: {ENV_PROCESS_ID}={process_id} not in "
                           f"[0, {ENV_NUM_PROCESSES}={num_processes})")
    return values[ENV_COORDINATOR], num_processes, process_id


def _seconds(environ, name: str) -> int | None:
    """A whole number of seconds >= 1 from a variable (jax.distributed takes ints); None when unset."""
    text = environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RuntimeError(f"jax_ep.launch.init_from_env: {name}={text!r} is not a number of seconds > 0")
    return max(1, int(round(value)))


def _joined(jax) -> tuple[int, int]:
    """(process_id, num_processes) of the initialized jax.distributed job, read without creating backends (a
    program may still configure devices after joining) through jax_ep's one private-API adapter."""
    from ..runtime.kv import joined_job

    got = joined_job()
    return got if got is not None else (jax.process_index(), jax.process_count())


def init_from_env(**initialize_kwargs) -> tuple[int, int]:
    """Join the job started by `python -m jax_ep.launch`; returns (process_id, num_processes).

    Under the launcher the child bootstrap has already joined (unless --no-join), and this is a no-op returning
    the job's (process_id, num_processes); so is any call after jax.distributed is initialized (an environment
    that disagrees with it is an error). Otherwise, when JAX_EP_COORDINATOR / JAX_EP_NUM_PROCESSES /
    JAX_EP_PROCESS_ID are all set, it calls `jax.distributed.initialize(coordinator_address, num_processes,
    process_id, **initialize_kwargs)` (initialization_timeout and heartbeat_timeout_seconds from
    JAX_EP_JOIN_TIMEOUT and JAX_EP_HEARTBEAT_TIMEOUT when set, unless given; JAX's
    cluster auto-detection off unless `cluster_detection_method` is given, so a SLURM allocation cannot override
    the launcher's ids or pin every process to device SLURM_LOCALID); when none is set it returns (0, 1) and
    initializes nothing (the same script runs standalone). Only some of them set is a RuntimeError.
    Before initializing it turns JAX's preemption service off (it makes a process ignore the launcher's SIGTERM)
    unless JAX_ENABLE_PREEMPTION_SERVICE is set, and sets `jax_cpu_collectives_implementation` to 'gloo' if it is
    'none'/unset (multi-process CPU collectives; already the default on jax 0.10.2). Call it before any JAX
    computation: backends must not exist yet when jax.distributed is initialized.
    """
    global _state
    with _lock:
        if _state is not None:
            return _state
        job = job_from_env()
        import jax

        if jax.distributed.is_initialized():
            got = _joined(jax)
            if job is not None and got != (job[2], job[1]):
                raise RuntimeError(f"jax_ep.launch.init_from_env: jax.distributed already initialized as process "
                                   f"{got[0]} of {got[1]}, environment says {job[2]} of {job[1]}")
            if initialize_kwargs:
                warnings.warn(f"jax_ep.launch.init_from_env: the job is already joined (the launcher joins before "
                              f"the program runs); ignoring {sorted(initialize_kwargs)}. Use the launcher's "
                              f"--join-timeout, or --no-join to pass your own arguments", stacklevel=2)
            _state = got
            return _state
        if job is None:
            _state = (0, 1)
            return _state
        coordinator, num_processes, process_id = job
        if num_processes > 1:
            impl = getattr(jax.config, "jax_cpu_collectives_implementation", None)
            if impl in (None, "", "none"):
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's preemption service installs a SIGTERM handler (the process then survives SIGTERM); under the
        # launcher SIGTERM means "another rank failed, stop now".
        if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ and hasattr(jax.config, "jax_enable_preemption_service"):
            jax.config.update("jax_enable_preemption_service", False)
        kwargs = dict(initialize_kwargs)
        for name, arg in ((ENV_JOIN_TIMEOUT, "initialization_timeout"),
                          (ENV_HEARTBEAT_TIMEOUT, "heartbeat_timeout_seconds")):
            value = _seconds(os.environ, name)
            if value is not None:
                kwargs.setdefault(arg, value)
        kwargs.setdefault("cluster_detection_method", "deactivate")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, **kwargs)
        _state = (process_id, num_processes)
        return _state
