"""Multi-process `jax_ep.initialize` (jax.process_count() > 1): agreement first, then the NVSHMEM transport.

1. agree   every process publishes a fingerprint of its setup (mesh axes/shape, device ids and owning processes,
           configs, resolved backends, the transport plan) through the jax.distributed key-value store and checks
           that all are equal (bootstrap.py). Runs for every backend; mismatches raise an EPError naming the field
           and the processes, on every process, before any collective.
2. connect for configs on the CUDA backend: NVSHMEM bootstrap, teams, symmetric buffers, external groups, warm-up
           (nvshmem_runtime.py), with one GPU per process: world PE = jax process index.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

from . import bootstrap, nvshmem_runtime, teams
from .validation import EPError

_lock = threading.Lock()
_generation = [0]


def next_generation() -> int:
    """A number per multi-process initialize of this process (the same on every process of a job that calls
    initialize the same number of times, which the agreement checks by waiting on the same keys)."""
    with _lock:
        _generation[0] += 1
        return _generation[0]


def timeout_of(configs) -> float:
    return max(float(c.timeout_seconds) for c in configs)


def _device_processes(mesh) -> dict:
    return {int(d.id): int(d.process_index) for d in mesh.devices.flat}


def group_pes(mesh, groups) -> dict:
    """axis -> [tuple of world PEs (jax process index of each rank's device), one per EP group]."""
    owner = _device_processes(mesh)
    return {axis: [tuple(owner[d] for d in g.device_ids) for g in gs] for axis, gs in groups.items()}


def fingerprint(mesh, configs, backends, transport: dict | None) -> dict:
    """What every process must agree on (JSON-able). Configs are sorted so their order in the call does not matter."""
    ordered = sorted(configs, key=repr)
    return {
        "jax_ep_version": _version(),
        "mesh": {"axis_names": [str(a) for a in mesh.axis_names], "shape": [int(s) for s in mesh.devices.shape],
                 "device_ids": [int(d.id) for d in mesh.devices.flat],
                 "device_processes": [int(d.process_index) for d in mesh.devices.flat]},
        "configs": [dataclasses.asdict(c) for c in ordered],
        "backends": [backends[c] for c in ordered],
        "transport": transport,
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("jax_ep")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source tree on sys.path)
        return "unknown"


def agree(generation: int, mesh, configs, backends, transport: dict | None) -> None:
    bootstrap.agree(generation, "initialize", fingerprint(mesh, configs, backends, transport), jax.process_index(),
                    jax.process_count(), timeout_of(configs))


def local_ordinal(mesh) -> int:
    """CUDA ordinal of this process's one device of the mesh (EPError unless there is exactly one)."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(mine) != 1:
        counts = {}
        for d in mesh.devices.flat:
            counts[int(d.process_index)] = counts.get(int(d.process_index), 0) + 1
        raise EPError(f"jax_ep.initialize: the CUDA backend with several processes needs exactly one GPU of the mesh "
                      f"per process (one NVSHMEM PE each); mesh devices per process: {counts}. Start one process "
                      f"per GPU (python -m jax_ep.launch -n N) or drive all local GPUs from one process")
    return int(getattr(mine[0], "local_hardware_id", mine[0].id))


def connect(generation: int, mesh, configs, groups: dict, cuda_configs, buffer_bytes: int, timings: dict):
    """NVSHMEM transport for the CUDA configs; sets native_id on this process's group of each axis. Collective."""
    ordinal = local_ordinal(mesh)
    pes_by_axis = group_pes(mesh, groups)
    axes = sorted({c.axis_name for c in cuda_configs})
    nvl = {}
    for c in cuda_configs:
        nvl.setdefault(c.axis_name, set()).add(c.num_max_nvl_peers)
    plan = teams.plan_teams({a: pes_by_axis[a] for a in axes}, nvl)
    teams.check_team_budget(plan)
    transport = nvshmem_runtime.setup(
        generation=generation, plan=plan, groups=pes_by_axis, axes=axes, buffer_bytes=buffer_bytes,
        device_ordinal=ordinal, process_id=jax.process_index(), num_processes=jax.process_count(),
        timeout_s=timeout_of(configs), timings=timings)
    me = jax.process_index()
    for axis in axes:
        for g, pes in zip(groups[axis], pes_by_axis[axis]):
            if me in pes:
                g.native_id = transport.native_ids[axis]
    return transport
