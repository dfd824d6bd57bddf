"""setup / finalize: the runtime half of jax_ep.initialize, backend choice, and what was set up.

`initialize(mesh, *configs)` does every expensive, collective step before tracing so the first jitted call runs
at steady-state speed. For the reference backend there is nothing to set up beyond recording the choice; for the
CUDA backend it creates a transport (transport.py: in-process peer access, or NVSHMEM with one process per GPU),
then binds every mesh axis in the native module (`bind_axis`): compiled programs carry only the config and the
axis name, and each device's handler resolves its group and buffers from that binding when it runs. With several
processes every initialize first checks, through the jax.distributed key-value store, that all processes set up the
same thing (agreement.py).

Lifetimes: `initialize` with more configs on the same mesh builds a new transport sized for all of them and rebinds
the axes; the previous transport is retired, not freed, until `finalize`, so a program compiled (or captured into a
CUDA graph) before stays valid. `finalize` unbinds the axes and releases every transport; programs compiled before
then need a new `initialize` (their handlers report the missing binding).

Imports point down only: this module uses the transports (peer.py, nvshmem.py), agreement.py and the native module;
no transport imports it. Its exit hook (one process per GPU) finalizes, then shuts NVSHMEM down.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from .. import _native
from ..config import MAX_GROUP_RANKS, EPConfig
from ..errors import EPError
from .kernel_env import kernel_environment, pull_combine_min_bytes
from .transport import requested as requested_transport

log = logging.getLogger("jax_ep")

_lock = threading.RLock()
_state: dict[str, Any] = {"runtime": None, "logged": set(), "exit_hook": False}


@dataclasses.dataclass(frozen=True)
class BufferSizeHint:
    """Device bytes one rank needs for a config on the CUDA backend (`buffer_size_hint`)."""

    normal_bytes: int  # normal-mode staging
    low_latency_bytes: int  # low-latency buffers (0 when the config has none)
    total_bytes: int


@dataclasses.dataclass
class GroupInfo:
    axis_name: str
    device_ids: tuple[int, ...]  # in rank order along axis_name


@dataclasses.dataclass
class Runtime:
    """What `initialize` set up. Printable; tests and the benchmark read it."""

    process_model: str  # "single-process" or "multi-process"
    transport: str  # "xla-collectives" (reference only), "cuda-peer" or "nvshmem"
    backends: dict  # EPConfig -> "reference" | "cuda"
    groups: dict  # axis name -> list[GroupInfo]
    buffer_bytes: int  # per device, allocated by jax_ep for the current transport (0 for the reference backend)
    timings: dict  # step name -> seconds
    configs: tuple
    mesh_shape: dict
    # Staging of every device = [normal region | low-latency region] (the native staging_plan).
    low_latency_offset: int = 0
    low_latency_bytes: int = 0
    teams: list = dataclasses.field(default_factory=list)  # NVSHMEM teams (dicts), one process per GPU
    transport_state: Any = None  # the current Transport (transport.py), None for the reference backend
    retired: list = dataclasses.field(default_factory=list)  # earlier transports, kept alive until finalize
    bound_axes: tuple = ()
    mesh: Any = None  # the jax.sharding.Mesh it was initialized on

    def summary(self) -> str:
        steps = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.timings.items())
        teams = f", {len(self.teams)} NVSHMEM team(s)" if self.teams else ""
        retired = f", {len(self.retired)} retired transport(s)" if self.retired else ""
        return (f"jax_ep runtime: {self.process_model}, transport {self.transport}, "
                f"{sum(len(g) for g in self.groups.values())} EP group(s){teams}{retired}, {self.buffer_bytes} "
                f"buffer bytes per device; {steps}")


# ---------------------------------------------------------------------------------------------------------------
# sizes (the layout formulas live in C++: cuda/include/jax_ep/staging_layout.h)
# ---------------------------------------------------------------------------------------------------------------
def _layout_module():
    if not _native.available():
        raise EPError(f"jax_ep: buffer sizes come from the native extension (the CUDA backend's layout), which is "
                      f"unavailable: {_native.load_error()}")
    return _native.module()


def check_group_ranks(op: str, what: str, num_ranks: int) -> None:
    """EPError unless num_ranks <= MAX_GROUP_RANKS (kMaxGroupRanks), on every backend: the one group-size limit of
    initialize and buffer_size_hint (the ops check it in ops/validation.py, check_kernel_limits)."""
    if num_ranks > MAX_GROUP_RANKS:
        raise EPError(f"jax_ep.{op}: {what} has {num_ranks} ranks; an EP group has at most {MAX_GROUP_RANKS} "
                      f"(kMaxGroupRanks of the CUDA kernels; checked on every backend, so that a program that runs "
                      f"here also runs on the GPUs)")


def buffer_size_hint(cfg: EPConfig, num_ranks: int) -> BufferSizeHint:
    """Device bytes one rank of an EP group of `num_ranks` needs for `cfg` on the CUDA backend.

    Like DeepEP's size hints: plan memory before `initialize`; `Runtime.buffer_bytes` reports what was allocated.
    Raises EPError for a num_ranks that is not a positive divisor of cfg.num_experts or above MAX_GROUP_RANKS (256,
    kMaxGroupRanks), or without the native extension.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise EPError(f"jax_ep.buffer_size_hint: num_ranks must be a positive int, got {num_ranks!r}")
    num_ranks = int(num_ranks)
    check_group_ranks("buffer_size_hint", "num_ranks", num_ranks)
    try:
        cfg.check_num_ranks(num_ranks)
    except ValueError as e:
        raise EPError(f"jax_ep.buffer_size_hint: {e}") from None
    m = _layout_module()
    over = cfg.normal_over_nvshmem(num_ranks)
    normal = int(m.normal_buffer_bytes(cfg.hidden, cfg.num_topk, cfg.max_tokens_per_rank, num_ranks,
                                       cfg.capacity(num_ranks), cfg.num_experts, over,
                                       cfg.num_max_nvl_peers if over else 0))
    low_latency = 0
    if cfg.uses_low_latency_buffers():
        low_latency = int(m.low_latency_buffer_bytes(cfg.hidden, cfg.max_tokens_per_rank, num_ranks, cfg.num_experts,
                                                     cfg.low_latency_over_nvshmem(num_ranks)))
    return BufferSizeHint(normal, low_latency, normal + low_latency)


def rdma_size_hint(cfg: EPConfig, num_ranks: int) -> int:
    """Bytes of NVSHMEM symmetric memory one rank needs for `cfg` with one process per GPU (DeepEP's RDMA size hint).

    In that model all of a config's staging is symmetric memory: its normal region and its low-latency region, each
    with the send area of the NVSHMEM puts when their ops run over NVSHMEM (cfg.normal_over_nvshmem(num_ranks),
    cfg.low_latency_over_nvshmem(num_ranks)). initialize sizes the
    heap (NVSHMEM_SYMMETRIC_SIZE) itself from the largest config per axis plus 256 MiB for NVSHMEM, unless the
    variable is set; set it from this hint when a later initialize of the same process will need more.
    Raises EPError like buffer_size_hint.
    """
    return buffer_size_hint(cfg, num_ranks).total_bytes


def buffer_advice(configs, num_ranks_of) -> str:
    """What each config's buffers hold per GPU and the settings that size them: the advice an allocation failure of
    `initialize` ends with (wide groups run out of memory first through the default recv_capacity, R * T_max)."""
    parts = []
    for c in configs:
        num_ranks = num_ranks_of(c)
        hint = buffer_size_hint(c, num_ranks)
        default = " (the default: R * max_tokens_per_rank)" if c.recv_capacity is None else ""
        parts.append(f"axis {c.axis_name!r} (R={num_ranks}, E={c.num_experts}, H={c.hidden}, "
                     f"max_tokens_per_rank={c.max_tokens_per_rank}): normal mode {hint.normal_bytes / 2**30:.2f} GiB "
                     f"with recv_capacity={c.capacity(num_ranks)} rows{default}, low latency "
                     f"{hint.low_latency_bytes / 2**30:.2f} GiB")
    return ("Buffers per GPU: " + "; ".join(parts) + ". Set EPConfig.recv_capacity to the rows a rank may receive "
            "(docs/INTERNODE_SCALING.md section 3), low_latency_buffers=False for configs that run no low-latency "
            "ops, or leave more GPU memory outside XLA's pool (XLA_PYTHON_CLIENT_MEM_FRACTION).")


def _out_of_memory(error: BaseException) -> bool:
    """Whether an allocation in the transport's setup failed for want of memory (cudaMalloc's "out of memory",
    NVSHMEM's heap allocation returning null)."""
    text = str(error).lower()
    return "out of memory" in text or "returned null" in text


def staging_plan(configs, num_ranks_of) -> tuple[int, int, int]:
    """(buffer_bytes, low_latency_offset, low_latency_bytes) of one device's staging for the CUDA `configs`
    (num_ranks_of(cfg) = R of its EP group): the native plan, [largest normal region | largest LL region]."""
    hints = [buffer_size_hint(c, num_ranks_of(c)) for c in configs]
    normal = [h.normal_bytes for h in hints]
    low_latency = [h.low_latency_bytes for h in hints if h.low_latency_bytes > 0]
    total, ll_offset, ll_bytes = _layout_module().staging_plan(normal, low_latency)
    return int(total), int(ll_offset), int(ll_bytes)


# ---------------------------------------------------------------------------------------------------------------
# backend choice
# ---------------------------------------------------------------------------------------------------------------
def log_once(key, msg, *args):
    """A warning once per process, printed by process 0 only (the others log it at debug level)."""
    if key not in _state["logged"]:
        _state["logged"].add(key)
        log.log(logging.WARNING if jax.process_index() == 0 else logging.DEBUG, msg, *args)


def _trace_platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) if device is not None else None
    return platform or jax.default_backend()


def resolve_backend(cfg: EPConfig, platform: str | None = None) -> str:
    """'reference' or 'cuda' for this config on this platform (backend='auto': cuda when the arrays live on CUDA
    devices and the extension is built, else reference, with one log line saying which)."""
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
    log_once(("auto", chosen, why), "jax_ep: backend='auto' uses the %s backend%s", chosen, why)
    return chosen


def _one_process_per_gpu() -> bool:
    """Whether CUDA configs of this job use the one-process-per-GPU transport (NVSHMEM): several processes, or one
    process with JAX_EP_TRANSPORT=nvshmem (runtime/transport.py)."""
    return jax.process_count() > 1 or requested_transport() == "nvshmem"


def _nvshmem_missing() -> str | None:
    """Why the one-process-per-GPU transport is unavailable (None when it is, or when it is not used)."""
    if not _one_process_per_gpu():
        return None
    from . import nvshmem

    status = nvshmem.availability()
    return None if status == "available" else status


# ---------------------------------------------------------------------------------------------------------------
# initialize / finalize
# ---------------------------------------------------------------------------------------------------------------
def _groups_of(mesh, axis_name: str) -> list[GroupInfo]:
    """One group per coordinate of the other mesh axes; device ids in rank order along axis_name."""
    if axis_name not in mesh.axis_names:
        raise EPError(f"jax_ep.initialize: EPConfig.axis_name={axis_name!r} is not an axis of the mesh "
                      f"(axes {tuple(mesh.axis_names)})")
    devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis_name), -1)
    rows = devices.reshape(-1, devices.shape[-1])
    return [GroupInfo(axis_name, tuple(int(d.id) for d in row)) for row in rows]


def setup(mesh: jax.sharding.Mesh, *configs: EPConfig, **kwargs) -> Runtime:
    """The runtime half of `jax_ep.initialize` (jax_ep/ops/initialize.py adds the warm-up run of the ops): eager,
    before tracing; idempotent for the same (mesh, configs).

    Sets up, for every config on the CUDA backend, the transport (buffers, peer access or NVSHMEM, teams), binds
    the mesh axes for the kernels and runs one warm-up exchange. Calling it again with more configs on the same
    mesh adds them (new buffers sized for all; the old ones are kept until finalize so earlier programs stay valid);
    with another mesh it finalizes the previous runtime first. With several processes it is collective.

    Raises EPError naming the argument for a wrong mesh axis, an axis of more than MAX_GROUP_RANKS (256,
    kMaxGroupRanks) devices, a config whose num_experts is not divisible by the axis size, or processes that
    disagree on the setup.
    """
    if kwargs:
        raise EPError(f"jax_ep.initialize: unexpected keyword arguments {sorted(kwargs)}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise EPError(f"jax_ep.initialize: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not configs:
        raise EPError("jax_ep.initialize: pass at least one EPConfig after the mesh")
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, EPConfig):
            raise EPError(f"jax_ep.initialize: configs[{i}] must be an EPConfig, got {type(cfg).__name__}")
    for i, cfg in enumerate(configs):  # before anything is torn down or set up, on every backend
        check_group_ranks("initialize", f"mesh axis {cfg.axis_name!r} (EPConfig.axis_name of configs[{i}])",
                          int(dict(mesh.shape).get(cfg.axis_name, 0)))
    kernel_environment()  # EPError naming a kernel variable (JAX_EP_LOW_LATENCY_PUT_BYTES) with an invalid value
    pull_combine_min_bytes()  # the same for JAX_EP_PULL_COMBINE_MIN_BYTES
    with _lock:
        current_rt: Runtime | None = _state["runtime"]
        mesh_shape = dict(mesh.shape)
        same_mesh = current_rt is not None and current_rt.mesh_shape == mesh_shape
        if same_mesh and set(configs) <= set(current_rt.configs):
            return current_rt
        all_configs = tuple(dict.fromkeys((current_rt.configs if same_mesh else ()) + configs))
        retired = []
        if current_rt is not None and not same_mesh:
            finalize()
        elif current_rt is not None:
            retired = current_rt.retired + ([current_rt.transport_state] if current_rt.transport_state else [])
        rt = _build(mesh, all_configs, retired)
        _state["runtime"] = rt
        log.info(rt.summary())
        return rt


def _build(mesh, configs, retired: list) -> Runtime:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    platform = mesh.devices.flat[0].platform if mesh.devices.size else jax.default_backend()
    backends, groups = {}, {}
    for cfg in configs:
        groups_for_axis = _groups_of(mesh, cfg.axis_name)
        try:
            cfg.check_num_ranks(len(groups_for_axis[0].device_ids))
        except ValueError as e:
            raise EPError(f"jax_ep.initialize: {e}") from None
        backends[cfg] = resolve_backend(cfg, platform)
        groups.setdefault(cfg.axis_name, groups_for_axis)
    timings["plan"] = time.perf_counter() - t0
    requested_transport()  # a bad JAX_EP_TRANSPORT is an error whatever the backends
    cuda_configs = [c for c, b in backends.items() if b == "cuda"]
    # one process per GPU (NVSHMEM): several processes, or CUDA configs with JAX_EP_TRANSPORT=nvshmem
    multi = jax.process_count() > 1 or (bool(cuda_configs) and _one_process_per_gpu())
    ranks_by_axis = {c.axis_name: len(groups[c.axis_name][0].device_ids) for c in cuda_configs}
    _check_normal_transport(cuda_configs, ranks_by_axis, multi)
    _check_low_latency_transport(cuda_configs, ranks_by_axis, multi)
    axes = sorted({c.axis_name for c in cuda_configs})
    buffer_bytes = ll_offset = ll_bytes = 0
    if cuda_configs:
        buffer_bytes, ll_offset, ll_bytes = staging_plan(cuda_configs,
                                                         lambda c: len(groups[c.axis_name][0].device_ids))
    transport = None
    try:
        if multi:
            transport = _connect_multi_process(mesh, configs, backends, groups, cuda_configs, axes, buffer_bytes,
                                               retired, timings)
        elif cuda_configs:
            from .peer import PeerTransport

            t1 = time.perf_counter()
            _native.ensure_registered()
            transport = PeerTransport.connect(groups, axes, buffer_bytes)
            timings["allocate_and_connect"] = time.perf_counter() - t1
    except Exception as e:
        if not cuda_configs or not _out_of_memory(e):
            raise
        raise EPError(f"jax_ep.initialize: allocating {buffer_bytes / 2**30:.2f} GiB of buffers per GPU failed: {e}. "
                      + buffer_advice(cuda_configs, lambda c: ranks_by_axis[c.axis_name])) from e
    if transport is not None:
        for axis in axes:
            _native.module().bind_axis(axis, transport.set_id(axis), ll_offset, ll_bytes)
    return Runtime(process_model="multi-process" if multi else "single-process",
                   transport=transport.name if transport else "xla-collectives", backends=backends, groups=groups,
                   buffer_bytes=buffer_bytes, timings=timings, configs=configs, mesh_shape=dict(mesh.shape),
                   low_latency_offset=ll_offset, low_latency_bytes=ll_bytes,
                   teams=transport.summary().get("teams", []) if transport else [], transport_state=transport,
                   retired=retired, bound_axes=tuple(axes) if transport else (), mesh=mesh)


def _check_normal_transport(cuda_configs, num_ranks: dict, one_process_per_gpu: bool) -> None:
    """The NVSHMEM normal-mode kernels (cfg.normal_over_nvshmem(R): a group wider than num_max_nvl_peers) need one
    process per GPU, and the configs of one mesh axis must agree on which kernels run and on their NVLink domain:
    their ops share the barrier counters, which count a pair's barriers with one mechanism (stores through a peer
    pointer, or NVSHMEM signals). num_ranks: axis -> R."""
    by_axis: dict = {}
    for c in cuda_configs:
        R = num_ranks[c.axis_name]
        over = c.normal_over_nvshmem(R)
        by_axis.setdefault(c.axis_name, set()).add((over, c.num_max_nvl_peers if over else 0))
        if len(by_axis[c.axis_name]) > 1:
            raise EPError(f"jax_ep.initialize: the CUDA configs of mesh axis {c.axis_name!r} disagree on the "
                          f"normal-mode kernels (num_max_nvl_peers against R={R}); every config of one axis must "
                          f"make the same choice")
        if c.normal_over_nvshmem(R) and not one_process_per_gpu:
            raise EPError(f"jax_ep.initialize: the normal-mode ops of axis {c.axis_name!r} (R={R}) run the NVSHMEM "
                          f"kernels (R > num_max_nvl_peers={c.num_max_nvl_peers}: a group wider than one NVLink "
                          f"domain), which need one process per GPU: start the program with python -m jax_ep.launch "
                          f"-n N, or set num_max_nvl_peers >= {R}")


def _check_low_latency_transport(cuda_configs, num_ranks: dict, one_process_per_gpu: bool) -> None:
    """The NVSHMEM low-latency kernels (cfg.low_latency_over_nvshmem(R): allow_nvlink_for_low_latency=False, or a group
    wider than num_max_nvl_peers) need the NVSHMEM transport and per_expert mode, and the configs of one mesh axis
    must agree on which kernels run and on their NVLink domain (their low-latency ops share one region and one
    consumed protocol, whose words each take one mechanism per pair of ranks). num_ranks: axis -> R."""
    by_axis: dict = {}
    for c in cuda_configs:
        if c.uses_low_latency_buffers():
            R = num_ranks[c.axis_name]
            over = c.low_latency_over_nvshmem(R)
            by_axis.setdefault(c.axis_name, set()).add((over, c.low_latency_nvl_domain() if over else 0))
            if over and c.low_latency_mode_for(R) == "per_rank":
                raise EPError(f"jax_ep.initialize: low_latency_mode='per_rank' (axis {c.axis_name!r}, R={R}) has "
                              f"no NVSHMEM kernels, which run when allow_nvlink_for_low_latency=False or R > "
                              f"num_max_nvl_peers ({c.num_max_nvl_peers}): use low_latency_mode 'per_expert' or "
                              f"'auto'")
    for axis, values in sorted(by_axis.items()):
        if len(values) > 1:
            raise EPError(f"jax_ep.initialize: the CUDA configs of mesh axis {axis!r} disagree on the low-latency "
                          f"kernels (EPConfig.allow_nvlink_for_low_latency, num_max_nvl_peers); every config of one "
                          f"axis must make the same choice")
        (over, _), = values
        if over and not one_process_per_gpu:
            raise EPError(f"jax_ep.initialize: the low-latency ops of axis {axis!r} (R={num_ranks[axis]}) run the "
                          f"NVSHMEM kernels (allow_nvlink_for_low_latency=False, or R > num_max_nvl_peers: a group "
                          f"wider than one NVLink domain), which need one process per GPU: start the program with "
                          f"python -m jax_ep.launch -n N (one GPU: JAX_EP_TRANSPORT=nvshmem python -m jax_ep.launch "
                          f"-n 1 ...)")


def _connect_multi_process(mesh, configs, backends, groups, cuda_configs, axes, buffer_bytes, retired, timings):
    from . import agreement, nvshmem

    t1 = time.perf_counter()
    generation = agreement.next_generation()
    kept = sum(t.buffer_bytes * len(t.buffers) for t in retired if hasattr(t, "buffers"))
    plan = nvshmem.prepare(buffer_bytes * len(axes) + kept) if cuda_configs else None
    agreement.agree_on_setup(generation, mesh, configs, backends, plan)
    timings["agree"] = time.perf_counter() - t1
    if plan is not None and plan["error"]:
        raise EPError(plan["error"])
    if not cuda_configs:
        return None
    _native.ensure_registered()
    transport = nvshmem.NvshmemTransport.connect(generation, mesh, groups, cuda_configs, buffer_bytes, timings)
    if not _state["exit_hook"]:
        # NOTE: registered after jax.distributed's own exit hook, so it runs first (atexit is LIFO) while the
        # key-value store that bounds NVSHMEM's exit barrier is still up.
        atexit.register(_at_exit)
        _state["exit_hook"] = True
    return transport


def finalize() -> None:
    """Releases what `initialize` set up (the current and every retired transport). Safe to call twice;
    `initialize` works again afterwards. Programs compiled before must not run again without a new `initialize`.

    One process per GPU with the CUDA backend: collective (every process calls it; a bounded key-value-store
    barrier comes first, then the groups, symmetric buffers and teams go). NVSHMEM itself stays up until the
    interpreter exits (docs/PROCESS_MODELS.md says why); the next initialize reuses it.
    """
    with _lock:
        rt: Runtime | None = _state["runtime"]
        _state["runtime"] = None
        if rt is None:
            return
        if _native.available():
            for axis in rt.bound_axes:
                _native.module().unbind_axis(axis)
        timeout = max((float(c.timeout_seconds) for c in rt.configs), default=100.0)
        errors = []
        for transport in [rt.transport_state, *rt.retired]:
            if transport is None:
                continue
            try:
                transport.teardown(timeout)
            except EPError as e:  # keep going: collective teardowns must run on every process
                errors.append(str(e))
        if errors:
            raise EPError("; ".join(errors))


def _at_exit() -> None:
    from . import nvshmem

    try:
        finalize()
    except Exception as e:  # noqa: BLE001 - never raise from an exit hook
        log.warning("jax_ep: finalize at exit failed: %s", e)
    try:
        nvshmem.shutdown()
    except Exception as e:  # noqa: BLE001
        log.warning("jax_ep: NVSHMEM shutdown at exit failed: %s", e)


def current() -> Runtime | None:
    """The runtime `initialize` set up last (None before, or after finalize)."""
    return _state["runtime"]


def runtime_for_trace(cfg: EPConfig, op: str) -> Runtime:
    """The runtime that knows `cfg`, for an op being traced on the CUDA backend.

    When the current runtime does not know cfg but its mesh is the mesh being traced (same axis names and sizes),
    cfg is added to it at trace time (collectively with several processes; logged once, since an explicit
    `initialize` before tracing is what makes the first call fast). JAX offers no public way to see the concrete
    devices of the program being traced, so jax_ep never guesses them: with no runtime, or a runtime on another
    mesh, it raises an EPError that says to call `jax_ep.initialize(mesh, cfg)`.
    """
    with _lock:
        rt: Runtime | None = _state["runtime"]
        if rt is not None and cfg in rt.backends:
            return rt
        if rt is None or not _is_traced_mesh(rt.mesh):
            where = ("no jax_ep runtime exists" if rt is None else
                     f"the runtime's mesh {rt.mesh_shape} is not the mesh of this program")
            raise EPError(f"jax_ep.{op}: no runtime knows {cfg} and {where}; call jax_ep.initialize(mesh, cfg) "
                          f"with the program's mesh before tracing (jax_ep cannot see a traced program's devices)")
        log_once(("lazy", cfg), "jax_ep: no runtime knew %s; adding it at trace time on the runtime's mesh %s. Pass "
                 "every config to jax_ep.initialize(mesh, ...) before tracing so the first call runs at full speed.",
                 cfg, rt.mesh_shape)
        return setup(rt.mesh, *rt.configs, cfg)


def _is_traced_mesh(mesh) -> bool:
    """Whether `mesh` has the axis names and sizes of the (abstract) mesh the current trace is bound to."""
    abstract = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(abstract, "axis_names", ()))
    return bool(names) and tuple(mesh.axis_names) == names and tuple(mesh.axis_sizes) == tuple(abstract.axis_sizes)


def warmup(program: Callable[..., Any], *example_args: Any, calls: int = 2) -> Any:
    """Runs a compiled or jitted program `calls` times on example inputs and waits for it: the serving-side half of
    the warm-up.

    `initialize` does jax_ep's own expensive steps (buffers, peer access or NVSHMEM, teams, kernel loading, one
    warm-up exchange), and the FFI handlers set up their per-call-site state when XLA compiles the program. What is
    left for the first execution of a program is XLA's own: loading the executable's module and kernels, growing
    its allocator for the outputs, and (on the second execution) recording the CUDA graph. Call this once after
    compiling and before timing or serving, with inputs of the real shapes; the program really runs (its jax_ep
    ops move data), so with several processes every process calls it the same way. Returns the last outputs.
    """
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise EPError(f"jax_ep.warmup: calls must be an int >= 1, got {calls!r}")
    if not callable(program):
        raise EPError(f"jax_ep.warmup: program must be a compiled or jitted function, got {type(program).__name__}")
    out = None
    for _ in range(calls):
        out = jax.block_until_ready(program(*example_args))
    return out
