"""initialize / finalize: the prewarm hook, backend choice, and what was set up.

`initialize(mesh, *configs)` does every expensive, collective step before tracing so the first jitted call runs
at steady-state speed. For the reference backend there is nothing to set up beyond recording the choice; for the
CUDA backend it creates, per EP group, the device buffers, peer access and pointer tables (single process) through
the native extension, or (one process per GPU) the NVSHMEM runtime, teams and symmetric buffers whose peer
pointers feed the same kernels (multiprocess.py, nvshmem_runtime.py). With several processes every initialize
first checks, through the jax.distributed key-value store, that all processes set up the same thing. Ops that
find no runtime for their config initialize at trace time and log once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import jax
import numpy as np

from . import _native
from .config import EPConfig
from .validation import EPError

log = logging.getLogger("jax_ep")

_lock = threading.RLock()
_state: dict[str, Any] = {"runtime": None, "logged": set()}


@dataclasses.dataclass(frozen=True)
class BufferSizeHint:
    normal_bytes: int  # per rank, normal-mode staging
    low_latency_bytes: int  # per rank, low-latency buffers
    total_bytes: int


@dataclasses.dataclass
class GroupInfo:
    axis_name: str
    device_ids: tuple[int, ...]  # in rank order along axis_name
    native_id: int | None = None  # id of the native group (CUDA backend)


@dataclasses.dataclass
class Runtime:
    """What `initialize` set up. Printable; tests and the benchmark read it."""

    process_model: str  # "single-process" or "multi-process"
    transport: str  # "xla-collectives" (reference), "cuda-peer" (in-process peer access) or "nvshmem"
    backends: dict  # EPConfig -> "reference" | "cuda"
    groups: dict  # (axis_name, mesh axis sizes) -> list[GroupInfo]
    buffer_bytes: int  # per device, allocated by jax_ep (0 for the reference backend)
    timings: dict  # step name -> seconds
    configs: tuple
    mesh_shape: dict
    # Staging of every device = [normal region | low-latency region]: the normal region holds the largest normal
    # layout of the configs, the low-latency region (two halves, used by alternate LL ops) starts right after it.
    low_latency_offset: int = 0
    low_latency_bytes: int = 0
    # One process per GPU with the CUDA backend: the NVSHMEM teams (dicts: kind, axis_name, group_index, nvl_index,
    # num_max_nvl_peers, pes, ranks, size, start, stride, member, my_rank, n_pes) and the nvshmem_runtime.Transport
    # that finalize tears down.
    teams: list = dataclasses.field(default_factory=list)
    nvshmem: Any = None

    def summary(self) -> str:
        steps = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.timings.items())
        teams = f", {len(self.teams)} NVSHMEM team(s)" if self.teams else ""
        return (f"jax_ep runtime: {self.process_model}, transport {self.transport}, "
                f"{sum(len(g) for g in self.groups.values())} EP group(s){teams}, {self.buffer_bytes} buffer bytes "
                f"per device; {steps}")


def buffer_size_hint(cfg: EPConfig, num_ranks: int) -> BufferSizeHint:
    """Device bytes one rank needs for `cfg` on the CUDA backend (like DeepEP's size hints)."""
    cfg.check_num_ranks(num_ranks)
    from . import buffer_layout

    normal = buffer_layout.normal_buffer_bytes(
        hidden=cfg.hidden, num_topk=cfg.num_topk, max_tokens_per_rank=cfg.max_tokens_per_rank,
        num_ranks=num_ranks, capacity=cfg.capacity(num_ranks), num_experts=cfg.num_experts)
    low_latency = 0
    if cfg.uses_low_latency_buffers():
        low_latency = buffer_layout.low_latency_buffer_bytes(
            hidden=cfg.hidden, max_tokens_per_rank=cfg.max_tokens_per_rank, num_ranks=num_ranks,
            num_experts=cfg.num_experts)
    return BufferSizeHint(normal, low_latency, normal + low_latency)


def staging_plan(configs, num_ranks_of) -> tuple[int, int, int]:
    """(buffer_bytes, low_latency_offset, low_latency_bytes) of one device's staging for the CUDA `configs`:
    the largest normal region, then the largest low-latency region (num_ranks_of(cfg) = R of its EP group)."""
    hints = [buffer_size_hint(c, num_ranks_of(c)) for c in configs]
    normal = max((h.normal_bytes for h in hints), default=0)
    low_latency = max((h.low_latency_bytes for h in hints), default=0)
    return normal + low_latency, normal, low_latency


def _log_once(key, msg, *args):
    if key not in _state["logged"]:
        _state["logged"].add(key)
        log.warning(msg, *args)


def _platform_of_devices(devices) -> str:
    return devices[0].platform if len(devices) else jax.default_backend()


def _trace_platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) if device is not None else None
    return platform or jax.default_backend()


def resolve_backend(cfg: EPConfig, platform: str | None = None) -> str:
    """'reference' or 'cuda' for this config on this platform (SPEC §2 'auto')."""
    platform = platform or _trace_platform()
    on_gpu = platform in ("gpu", "cuda")
    if cfg.backend == "reference":
        return "reference"
    if cfg.backend == "cuda":
        if not _native.available():
            raise EPError(f"EPConfig.backend='cuda' but the jax_ep CUDA extension is not available: "
                          f"{_native.load_error()}")
        if not on_gpu:
            raise EPError(f"EPConfig.backend='cuda' needs arrays on CUDA devices; this program runs on {platform!r}")
        missing = _nvshmem_missing()
        if missing:
            raise EPError(f"EPConfig.backend='cuda': {missing}")
        return "cuda"
    nvshmem_missing = _nvshmem_missing() if (on_gpu and _native.available()) else None
    chosen = "cuda" if (on_gpu and _native.available() and not nvshmem_missing) else "reference"
    why = "" if chosen == "cuda" else (
        f" (platform {platform!r})" if not on_gpu else
        f" (CUDA extension unavailable: {_native.load_error()})" if not _native.available() else
        f" ({nvshmem_missing})")
    _log_once(("auto", cfg, chosen), "jax_ep: backend='auto' uses the %s backend%s", chosen, why)
    return chosen


def _nvshmem_missing() -> str | None:
    """Why the one-process-per-GPU transport is unavailable (None when it is, or with one process)."""
    if jax.process_count() == 1:
        return None
    from . import nvshmem_runtime

    status = nvshmem_runtime.availability()
    return None if status == "available" else status


def _groups_of(mesh, axis_name: str) -> list[GroupInfo]:
    """One group per coordinate of the other mesh axes; device ids in rank order along axis_name."""
    if axis_name not in mesh.axis_names:
        raise EPError(f"jax_ep.initialize: EPConfig.axis_name={axis_name!r} is not an axis of the mesh "
                      f"(axes {tuple(mesh.axis_names)})")
    devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis_name), -1)
    rows = devices.reshape(-1, devices.shape[-1])
    return [GroupInfo(axis_name, tuple(int(d.id) for d in row)) for row in rows]


def initialize(mesh, *configs: EPConfig, **kwargs) -> Runtime:
    """Prewarm hook: eager, before tracing; idempotent for the same (mesh, configs).

    Calling it again with more configs adds them (buffers are sized for the largest); calling it with another
    mesh finalizes the previous runtime first.
    """
    if kwargs:
        raise EPError(f"jax_ep.initialize: unexpected keyword arguments {sorted(kwargs)}")
    if not configs:
        raise EPError("jax_ep.initialize: pass at least one EPConfig after the mesh")
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, EPConfig):
            raise EPError(f"jax_ep.initialize: configs[{i}] must be an EPConfig, got {type(cfg).__name__}")
    with _lock:
        current: Runtime | None = _state["runtime"]
        mesh_shape = dict(mesh.shape)
        if current is not None and current.mesh_shape == mesh_shape and set(configs) <= set(current.configs):
            return current
        all_configs = tuple(dict.fromkeys((current.configs if current and current.mesh_shape == mesh_shape
                                           else ()) + configs))
        if current is not None:
            finalize()
        _state["runtime"] = _build(mesh, all_configs)
        log.info(_state["runtime"].summary())
        return _state["runtime"]


def _build(mesh, configs) -> Runtime:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    platform = _platform_of_devices(mesh.devices.flat)
    backends, groups = {}, {}
    for cfg in configs:
        groups_for_axis = _groups_of(mesh, cfg.axis_name)
        cfg.check_num_ranks(len(groups_for_axis[0].device_ids))
        backends[cfg] = resolve_backend(cfg, platform)
        groups.setdefault(cfg.axis_name, groups_for_axis)
    timings["plan"] = time.perf_counter() - t0
    multi = jax.process_count() > 1
    buffer_bytes = ll_offset = ll_bytes = 0
    transport = "xla-collectives"
    cuda_configs = [c for c, b in backends.items() if b == "cuda"]
    if cuda_configs:
        buffer_bytes, ll_offset, ll_bytes = staging_plan(
            cuda_configs, lambda c: len(groups[c.axis_name][0].device_ids))
    nvshmem = None
    if multi:
        from . import multiprocess, nvshmem_runtime

        t1 = time.perf_counter()
        generation = multiprocess.next_generation()
        num_axes = len({c.axis_name for c in cuda_configs})
        plan = nvshmem_runtime.prepare(buffer_bytes * num_axes) if cuda_configs else None
        multiprocess.agree(generation, mesh, configs, backends, plan)
        timings["agree"] = time.perf_counter() - t1
        if plan is not None and plan["error"]:
            raise EPError(plan["error"])
        if cuda_configs:
            _native.ensure_registered()
            nvshmem = multiprocess.connect(generation, mesh, configs, groups, cuda_configs, buffer_bytes, timings)
            transport = "nvshmem"
    elif cuda_configs:
        t1 = time.perf_counter()
        _native.ensure_registered()
        for axis in {c.axis_name for c in cuda_configs}:
            set_id = -1  # the groups of one mesh axis (e.g. dp x ep) share a set id: one handler attribute value
            for group in groups[axis]:
                ordinals = [_local_ordinal(d) for d in group.device_ids]
                group.native_id = _native.module().intranode_create_group(ordinals, buffer_bytes, set_id)
                set_id = groups[axis][0].native_id
        timings["allocate_and_connect"] = time.perf_counter() - t1
        transport = "cuda-peer"
    return Runtime(process_model="multi-process" if multi else "single-process", transport=transport,
                   backends=backends, groups=groups, buffer_bytes=buffer_bytes, timings=timings,
                   configs=configs, mesh_shape=dict(mesh.shape), low_latency_offset=ll_offset,
                   low_latency_bytes=ll_bytes, teams=[t.summary() for t in nvshmem.teams] if nvshmem else [],
                   nvshmem=nvshmem)


def _local_ordinal(device_id: int) -> int:
    for d in jax.local_devices():
        if d.id == device_id:
            return int(getattr(d, "local_hardware_id", d.id))
    raise EPError(f"jax_ep.initialize: device {device_id} is not local to this process")


def finalize() -> None:
    """Releases what `initialize` set up. Safe to call twice; `initialize` works again afterwards.

    One process per GPU with the CUDA backend: collective (every process calls it; a bounded key-value-store
    barrier comes first, then the groups, symmetric buffers and teams go). NVSHMEM itself stays up until the
    interpreter exits (docs/PROCESS_MODELS.md says why); the next initialize reuses it.
    """
    with _lock:
        current: Runtime | None = _state["runtime"]
        _state["runtime"] = None
        if current is None:
            return
        if current.nvshmem is not None:
            from . import multiprocess, nvshmem_runtime

            for groups in current.groups.values():
                for group in groups:
                    group.native_id = None
            nvshmem_runtime.teardown(current.nvshmem, multiprocess.timeout_of(current.configs))
            return
        for groups in current.groups.values():
            for group in groups:
                if group.native_id is not None:
                    _native.module().intranode_destroy_group(group.native_id)
                    group.native_id = None


def current() -> Runtime | None:
    return _state["runtime"]


def runtime_for(cfg: EPConfig) -> Runtime:
    """The runtime that knows `cfg`; initializes at trace time (logging once) when there is none."""
    with _lock:
        rt: Runtime | None = _state["runtime"]
        if rt is not None and cfg in rt.backends:
            return rt
        mesh = jax.sharding.get_abstract_mesh()
        _log_once(("lazy", cfg), "jax_ep: no runtime for %s; initializing at trace time. Call "
                  "jax_ep.initialize(mesh, cfg) before tracing so the first call runs at full speed.", cfg)
        concrete = _guess_mesh(mesh)
        if rt is not None and rt.mesh_shape == dict(concrete.shape):
            return initialize(concrete, *rt.configs, cfg)
        return initialize(concrete, cfg)


def _guess_mesh(abstract_mesh):
    """The concrete mesh of the program being traced is not visible inside shard_map: rebuild it in
    `jax.make_mesh` order. Explicit `initialize(mesh, ...)` avoids the guess (docs/API.md)."""
    names = tuple(abstract_mesh.axis_names)
    sizes = tuple(abstract_mesh.axis_sizes)
    devices = np.asarray(jax.devices()[: int(np.prod(sizes))]).reshape(sizes)
    return jax.sharding.Mesh(devices, names)


def group_id_for(cfg: EPConfig) -> int:
    """Native group-set id for the CUDA backend: every device finds its own group (and rank) from it and its
    device ordinal, so one attribute value serves all EP groups of the mesh."""
    rt = runtime_for(cfg)
    # One process: group 0 holds the set id every group of the axis shares. One process per GPU: only this
    # process's group has a native id (it is its own set).
    ids = [g.native_id for g in rt.groups[cfg.axis_name] if g.native_id is not None]
    if not ids:
        raise EPError(f"jax_ep: config {cfg} does not use the CUDA backend in the current runtime")
    return ids[0]
