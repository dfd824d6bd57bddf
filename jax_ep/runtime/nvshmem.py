"""The one-process-per-GPU transport: NVSHMEM bootstrap, teams, symmetric buffers, peer pointers.

Used by `jax_ep.initialize` when `jax.process_count() > 1` and a config runs on the CUDA backend. Steps (each timed
into `Runtime.timings`), all collective and made in the same order on every process:
  1. bootstrap  process 0 makes the NVSHMEM unique id, the jax.distributed key-value store carries it, every process
                joins as PE = its jax process index on its one GPU (`nvshmemx_hostlib_init_attr`), init status checked.
                Once per process: NVSHMEM stays up across `jax_ep.finalize()` (see `shutdown`).
  2. teams      one team per EP group, plus the NVLink-local-index sub teams when R > num_max_nvl_peers (teams.py).
     device     (module built with NVSHMEM's device library) every PE sends counted put-with-signal messages to
                every PE from a kernel and checks them (nvshmem/device/device_check.cu): the device state, the
                device library and the transport between every pair of PEs work before any program runs.
  3. allocate   one zeroed symmetric buffer per mesh axis (nvshmem_align, sized like the single-process staging);
                nvshmem_ptr of every rank of this process's group -> a native external group, so the same kernels
                as in one process run over these peer pointers.
  4. warmup     one device-side barrier through jax_ep's own kernels on every group.

A leaf of the runtime: it never imports the lifecycle above it (the lifecycle's exit hook calls `shutdown`).
NVSHMEM is loaded lazily from the separate module jax_ep._jax_ep_nvshmem: `import jax_ep` never loads it, and asking
for this mode without it gives an EPError that says what is missing. nvshmem_env.py decides the NVSHMEM_* variables.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import threading
import time

import jax

from .. import _native
from ..errors import EPError
from . import agreement, receive_pools, teams as teams_mod
from .nvshmem_env import HEAP_HEADROOM_BYTES, NATIVE_MODULE, nvshmem_environment, parse_size

log = logging.getLogger("jax_ep")

_MODULE_NAME = NATIVE_MODULE  # the separate native module at the package root (nvshmem_env.py names it)
_lock = threading.RLock()
# NVSHMEM's process-wide state as jax_ep sees it: the heap size fixed at init, whether the exit hook is in place.
_process: dict = {"module": None, "heap_bytes": None, "exit_timeout_s": 100.0}

# ---------------------------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------------------------


def module():
    """jax_ep._jax_ep_nvshmem, imported on first use; EPError saying what is missing when it cannot be."""
    with _lock:
        if _process["module"] is not None:
            return _process["module"]
        if importlib.util.find_spec(_MODULE_NAME) is None:
            raise EPError(
                "jax_ep: one process per GPU with backend='cuda' needs the NVSHMEM module jax_ep._jax_ep_nvshmem, "
                "which was not built (the build needs a CUDA toolkit and the nvidia-nvshmem-cu13 wheel with "
                "lib/libnvshmem_host.so.3; see docs/BUILDING.md). Use backend='reference' or one process driving "
                "all local GPUs")
        _preload_nvshmem_host()
        try:
            _process["module"] = importlib.import_module(_MODULE_NAME)
        except ImportError as e:
            raise EPError(f"jax_ep: the NVSHMEM module jax_ep._jax_ep_nvshmem failed to load ({e}); it needs "
                          f"libnvshmem_host.so.3 of the nvidia-nvshmem-cu13 wheel it was built against "
                          f"(docs/BUILDING.md)") from None
        return _process["module"]


def _preload_nvshmem_host() -> None:
    """Loads libnvshmem_host.so.3 from the nvidia-nvshmem-cu13 package by its path, when that package is importable,
    so the module's relative RUNPATH is not the only way to find it (a venv that sees the system's packages, a user
    site install). Nothing happens when the package is absent: the RUNPATH then decides."""
    import ctypes

    try:
        import nvidia.nvshmem as pkg  # the wheel's namespace package
    except ImportError:
        return
    for root in getattr(pkg, "__path__", []):
        lib = os.path.join(root, "lib", "libnvshmem_host.so.3")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


def availability() -> str:
    """'available' or why the NVSHMEM module cannot be used (never raises; goes into the setup fingerprint)."""
    try:
        module()
        return "available"
    except EPError as e:
        return str(e)


def _apply_environment(env: dict) -> None:
    for k, v in env.items():
        old = os.environ.get(k)
        if old is not None and old != v:
            log.warning("jax_ep: %s=%s overridden with %s (NVLink multicast stays off)", k, old, v)
        os.environ[k] = v


# ---------------------------------------------------------------------------------------------------------
# setup / teardown
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Team:
    spec: teams_mod.TeamSpec
    handle: int | None  # NVSHMEM team handle on members, None elsewhere
    my_rank: int | None  # this PE's rank in the team (members)
    n_pes: int | None  # nvshmem_team_n_pes as NVSHMEM reports it (members)

    def summary(self) -> dict:
        s = self.spec
        return {"kind": s.kind, "axis_name": s.axis_name, "group_index": s.group_index,
                "nvl_index": s.nvl_index, "node_index": s.node_index, "num_max_nvl_peers": s.num_max_nvl_peers,
                "pes": list(s.pes), "ranks": list(s.ranks), "size": s.size, "start": s.start, "stride": s.stride,
                "member": self.handle is not None, "my_rank": self.my_rank, "n_pes": self.n_pes}


@dataclasses.dataclass
class NvshmemTransport:
    """What the NVSHMEM setup of one runtime holds (the runtime.transport.Transport protocol)."""

    pe: int
    n_pes: int
    device_ordinal: int
    teams: list  # [Team], in split order
    buffers: dict  # axis name -> this PE's symmetric buffer address
    native_ids: dict  # axis name -> jax_ep external group id (this process's group on that axis)
    buffer_bytes: int
    heap_bytes: int
    version: str
    generation: int
    device_check: dict | None = None  # what this PE saw in the device-API check; None without the device library
    unmapped: dict = dataclasses.field(default_factory=dict)  # axis -> ranks out of load/store reach (other hosts)
    receive_pools: dict = dataclasses.field(default_factory=dict)  # axis -> "on" / "off: why" (receive_pools.py)
    name: str = "nvshmem"

    @classmethod
    def connect(cls, generation: int, mesh, groups: dict, cuda_configs, buffer_bytes: int,
                timings: dict) -> "NvshmemTransport":
        """Collective: NVSHMEM (once per process), teams, symmetric buffers, external groups, warm-up."""
        ordinal = local_ordinal(mesh)
        pes_by_axis = agreement.group_pes(mesh, groups)
        axes = sorted({c.axis_name for c in cuda_configs})
        nvl: dict = {}
        for c in cuda_configs:
            nvl.setdefault(c.axis_name, set()).add(c.num_max_nvl_peers)
        plan, note = teams_mod.plan_within_budget({a: pes_by_axis[a] for a in axes}, nvl,
                                                  existing=tuple(_process.get("teams", {})))
        if note:
            log.warning(note)
        # per axis with low-latency buffers: the NVLink domain of the NVSHMEM LL kernels, 0 for the NVLink kernels
        # (every rank needs a pointer); the configs of one axis agree (lifecycle._check_low_latency_transport)
        ll_domains = {c.axis_name: (c.low_latency_nvl_domain()
                                    if c.low_latency_over_nvshmem(len(pes_by_axis[c.axis_name][0])) else 0)
                      for c in cuda_configs if c.uses_low_latency_buffers()}
        # per axis whose normal-mode dispatch forwards inside nodes (EPConfig.normal_dispatch_forwarded): the node
        # size; every rank of a node must be mapped (check_unmapped)
        forward_domains = {c.axis_name: c.num_max_nvl_peers for c in cuda_configs
                           if c.normal_dispatch_forwarded(len(pes_by_axis[c.axis_name][0]))}
        return setup(generation=generation, plan=plan, groups=pes_by_axis, axes=axes, buffer_bytes=buffer_bytes,
                     device_ordinal=ordinal, process_id=jax.process_index(), num_processes=jax.process_count(),
                     timeout_s=agreement.timeout_of(cuda_configs), timings=timings,
                     needs_device_library=any(ll_domains.values()) or any(
                         c.normal_over_nvshmem(len(pes_by_axis[c.axis_name][0])) for c in cuda_configs),
                     ll_domains=ll_domains, forward_domains=forward_domains,
                     device=next(d for d in mesh.devices.flat if d.process_index == jax.process_index()),
                     pool_axes={c.axis_name for c in cuda_configs
                                if not c.normal_over_nvshmem(len(pes_by_axis[c.axis_name][0]))})

    def set_id(self, axis: str) -> int:
        return self.native_ids[axis]  # one process per GPU: this process's group is its own set

    def group_ids(self) -> list[int]:
        return list(self.native_ids.values())

    def summary(self) -> dict:
        return {"transport": self.name, "pe": self.pe, "n_pes": self.n_pes, "buffer_bytes": self.buffer_bytes,
                "heap_bytes": self.heap_bytes, "nvshmem": self.version, "teams": [t.summary() for t in self.teams],
                "device_check": self.device_check, "unmapped": self.unmapped, "receive_pools": self.receive_pools}

    def teardown(self, timeout_s: float) -> None:
        teardown(self, timeout_s)


def local_ordinal(mesh) -> int:
    """CUDA ordinal of this process's one device of the mesh (EPError unless there is exactly one)."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(mine) != 1:
        counts: dict = {}
        for d in mesh.devices.flat:
            counts[int(d.process_index)] = counts.get(int(d.process_index), 0) + 1
        raise EPError(f"jax_ep.initialize: the CUDA backend with several processes needs exactly one GPU of the mesh "
                      f"per process (one NVSHMEM PE each); mesh devices per process: {counts}. Start one process "
                      f"per GPU (python -m jax_ep.launch -n N) or drive all local GPUs from one process")
    return int(getattr(mine[0], "local_hardware_id", mine[0].id))


def prepare(required_heap_bytes: int) -> dict:
    """This process's view of the transport plan, for the setup fingerprint (never raises: an error goes in)."""
    info = {"module": availability(), "required_heap_bytes": int(required_heap_bytes), "error": None}
    if info["module"] != "available":
        return info
    m = module()
    info["initialized"] = bool(m.initialized())
    try:
        info["max_teams"] = teams_mod.team_limit()  # the team plan (plan_within_budget) depends on it
        if m.initialized():
            heap = _process["heap_bytes"]
            if heap is not None and required_heap_bytes + HEAP_HEADROOM_BYTES > heap:
                raise EPError(f"jax_ep.initialize: these configs need {required_heap_bytes} bytes of symmetric "
                              f"buffers but NVSHMEM was started with a {heap}-byte heap by an earlier initialize "
                              f"(fixed for the life of the process); set NVSHMEM_SYMMETRIC_SIZE large enough "
                              f"before the first jax_ep.initialize")
        else:
            info["environment"] = nvshmem_environment(required_heap_bytes)
    except EPError as e:
        info["error"] = str(e)
    return info


def setup(*, generation: int, plan: list, groups: dict, axes: list, buffer_bytes: int, device_ordinal: int,
          process_id: int, num_processes: int, timeout_s: float, timings: dict,
          needs_device_library: bool = False, ll_domains: dict | None = None,
          forward_domains: dict | None = None, device=None, pool_axes=()) -> NvshmemTransport:
    """Bootstrap (once per process), teams, symmetric buffers and external groups, warm-up. Collective.

    plan: teams.plan_within_budget(...)[0] (every process the same); groups: axis -> list of PE tuples in rank order;
    axes: the mesh axes with CUDA configs, in the order buffers are allocated; ll_domains: axis -> NVLink domain of
    its low-latency kernels, forward_domains: axis -> node size of its forwarded normal-mode dispatch
    (check_unmapped); device: this process's jax device, whose XLA pool becomes its receive pool on each axis of
    pool_axes (those whose normal mode runs the NVLink kernels; receive_pools.py).
    """
    m = module()
    t = time.perf_counter()
    if not m.initialized():
        env = nvshmem_environment(buffer_bytes * len(axes))
        _apply_environment(env)
        uid = m.get_unique_id() if process_id == 0 else None
        uid = agreement.broadcast_bytes(generation, "nvshmem_unique_id", uid, process_id, timeout_s)
        try:
            m.init(process_id, num_processes, uid, device_ordinal)
        except RuntimeError as e:
            raise EPError(f"jax_ep.initialize: NVSHMEM init failed on process {process_id}: {e}") from None
        _process["heap_bytes"] = parse_size(env["NVSHMEM_SYMMETRIC_SIZE"])
        _process["exit_timeout_s"] = timeout_s
        timings["bootstrap"] = time.perf_counter() - t
    elif m.my_pe() != process_id or m.n_pes() != num_processes:
        raise EPError(f"jax_ep.initialize: NVSHMEM runs as PE {m.my_pe()} of {m.n_pes()} in this process, but the "
                      f"job now has process {process_id} of {num_processes}")
    else:
        timings["bootstrap"] = 0.0  # NVSHMEM already up (an earlier initialize of this process)

    made: list[Team] = []
    buffers: dict = {}
    unmapped: dict = {}  # axis -> ranks of this process's group without a load/store pointer (other hosts)
    native_ids: dict = {}
    try:
        t = time.perf_counter()
        teams = _process.setdefault("teams", {})
        for spec in plan:
            key = (spec.start, spec.stride, spec.size)
            if key not in teams:  # collective split, the same on every process (the same plans in the same order)
                teams[key] = m.team_split_strided(spec.start, spec.stride, spec.size)
            handle = teams[key]
            team = Team(spec, handle, None, None)
            made.append(team)
            if (handle is not None) != (process_id in spec.pes):
                raise EPError(f"jax_ep.initialize: NVSHMEM made process {process_id} "
                              f"{'a member' if handle is not None else 'not a member'} of the team of "
                              f"{spec.describe()}")
            if handle is not None:
                team.my_rank, team.n_pes = m.team_my_pe(handle), m.team_n_pes(handle)
                if team.n_pes != spec.size or team.my_rank != spec.pes.index(process_id):
                    raise EPError(f"jax_ep.initialize: NVSHMEM team of {spec.describe()} has {team.n_pes} PEs and "
                                  f"this process as rank {team.my_rank}; expected {spec.size} and "
                                  f"{spec.pes.index(process_id)}")
        timings["teams"] = time.perf_counter() - t

        device_api = None
        if m.has_device_library():
            t = time.perf_counter()
            device_api = check_device_api(m, process_id, timeout_s)
            timings["device_check"] = time.perf_counter() - t
            # the NVSHMEM kernels (EPConfig.low_latency_over_nvshmem, normal_over_nvshmem) for the native handlers
            _native.module().set_low_latency_nvshmem_ops(m.low_latency_nvshmem_ops())
            _native.module().set_normal_nvshmem_ops(m.normal_nvshmem_ops())
        elif needs_device_library:
            raise EPError("jax_ep.initialize: the NVSHMEM kernels (EPConfig.allow_nvlink_for_low_latency="
                          "False, or R > num_max_nvl_peers) need NVSHMEM's device library in jax_ep._jax_ep_nvshmem, and this build has none (the nvidia-nvshmem-cu13 "
                          "wheel it was built against lacks lib/libnvshmem_device.a; docs/BUILDING.md)")

        t = time.perf_counter()
        for axis in axes:
            buffers[axis] = m.malloc(buffer_bytes)
            mine = [pes for pes in groups[axis] if process_id in pes]
            if len(mine) != 1:
                raise EPError(f"jax_ep.initialize: process {process_id} is in {len(mine)} EP groups of axis "
                              f"{axis!r}; one process per GPU needs exactly one")
            pes = mine[0]
            peers = [m.ptr(buffers[axis], pe) if _same_simulated_host(pes.index(process_id), r) else 0
                     for r, pe in enumerate(pes)]
            unmapped[axis] = [r for r, p in enumerate(peers) if not p]
            check_unmapped(axis, pes.index(process_id), unmapped[axis], (ll_domains or {}).get(axis),
                           (forward_domains or {}).get(axis))
            if unmapped[axis]:
                # another host: the NVSHMEM kernels of both modes reach it by puts; the pointer kernels refuse (the
                # handlers name the ranks); initialize says so once here
                log.warning("jax_ep.initialize: ranks %s of this process's EP group on axis %r have no load/store "
                            "mapping (other hosts): ops reach them with NVSHMEM puts when R > num_max_nvl_peers "
                            "(normal mode) or the low-latency NVSHMEM kernels run; the NVLink kernels refuse such "
                            "a group (docs/INTERNODE.md)", unmapped[axis], axis)
            native_ids[axis] = _native.module().group_register_external(
                device_ordinal, pes.index(process_id), peers, buffer_bytes, -1, list(pes))
        timings["allocate"] = time.perf_counter() - t

        t = time.perf_counter()
        pools: dict = {}
        for axis in [a for a in axes if a in pool_axes] if device is not None else ():
            pes = next(p for p in groups[axis] if process_id in p)
            pools[axis] = receive_pools.connect(
                generation=generation, axis=axis, native_id=native_ids[axis], pes=tuple(pes), process_id=process_id,
                device=device, device_ordinal=device_ordinal, unmapped=unmapped[axis], timeout_s=timeout_s)
        timings["receive_pools"] = time.perf_counter() - t

        t = time.perf_counter()
        timeout_ns = int(timeout_s * 1e9)
        for axis in axes:
            _native.module().group_warmup(native_ids[axis], timeout_ns)
        timings["warmup"] = time.perf_counter() - t
    except BaseException:
        # NOTE: a failure above is usually local to this process, so only local state is released here (no NVSHMEM
        # collective: the other processes may be elsewhere). Teams and buffers already made stay with NVSHMEM, which
        # releases them when it is finalized at exit.
        for nid in native_ids.values():
            try:
                _native.module().group_destroy(nid)
            except Exception:
                pass
        raise
    return NvshmemTransport(pe=process_id, n_pes=num_processes, device_ordinal=device_ordinal, teams=made,
                     buffers=buffers, native_ids=native_ids, buffer_bytes=buffer_bytes,
                     heap_bytes=int(_process["heap_bytes"] or 0), version=m.runtime_version(), generation=generation,
                     device_check=device_api, unmapped=unmapped, receive_pools=pools)


def check_unmapped(axis: str, rank: int, unmapped: list, ll_domain: int | None,
                   forward_domain: int | None = None) -> None:
    """EPError when the kernels of `axis` would need a pointer NVSHMEM cannot give.

    ll_domain (low-latency kernels): 0 (the NVLink kernels: every rank of the group) or the NVLink domain size
    (ranks q with q // ll_domain == rank // ll_domain are reached by stores); None: the axis has no low-latency
    buffers (normal-mode ops on such a group run the NVSHMEM kernels when R > num_max_nvl_peers, and are refused
    when they run, naming the ranks, otherwise). forward_domain: the node size of a forwarded normal-mode dispatch
    (EPConfig.normal_dispatch_forwarded), whose forwarders store into every rank of their node: all of them must be
    mapped, or the group's ranks would disagree on the protocol."""
    if not unmapped:
        return
    fix = "set EPConfig.num_max_nvl_peers to the GPUs per host (the ranks NVSHMEM maps to each other)"
    if forward_domain:
        inside = [q for q in unmapped if q // forward_domain == rank // forward_domain]
        if inside:
            raise EPError(f"jax_ep.initialize: ranks {inside} of the EP group on axis {axis!r} are in rank {rank}'s "
                          f"node of num_max_nvl_peers={forward_domain} ranks, through which normal-mode dispatch "
                          f"forwards tokens by stores, but NVSHMEM gives no load/store mapping to them (other "
                          f"hosts?): {fix}")
    if ll_domain is None:
        return
    if ll_domain == 0:
        raise EPError(f"jax_ep.initialize: ranks {unmapped} of the EP group on axis {axis!r} have no load/store "
                      f"mapping from rank {rank} (other hosts), but its low-latency configs would run the NVLink "
                      f"kernels (R <= num_max_nvl_peers): {fix}")
    inside = [q for q in unmapped if q // ll_domain == rank // ll_domain]
    if inside:
        raise EPError(f"jax_ep.initialize: ranks {inside} of the EP group on axis {axis!r} share rank {rank}'s "
                      f"NVLink domain (num_max_nvl_peers={ll_domain}) but NVSHMEM gives no load/store mapping to "
                      f"them (other hosts?): {fix}")


def _same_simulated_host(rank: int, other: int) -> bool:
    """Test hook JAX_EP_TEST_RANKS_PER_HOST=k: ranks r and q of a group count as on different hosts when
    r // k != q // k, and get no load/store pointer, as across real hosts (on one host NVSHMEM maps every peer).
    Unset: every rank NVSHMEM maps is used."""
    k = os.environ.get("JAX_EP_TEST_RANKS_PER_HOST")
    if not k:
        return True
    if not k.isdigit() or int(k) < 1:
        raise EPError(f"JAX_EP_TEST_RANKS_PER_HOST must be a positive integer, got {k!r}")
    return rank // int(k) == other // int(k)


def check_device_api(m, process_id: int, timeout_s: float) -> dict:
    """Collective: the device-API check of the NVSHMEM module; EPError naming what failed on this process."""
    try:
        r = dict(m.device_check(timeout_s))
    except RuntimeError as e:
        raise EPError(f"jax_ep.initialize: NVSHMEM device check failed on process {process_id}: {e}") from None
    n = r["n_pes"]
    problems = []
    if r["my_pe"] != m.my_pe() or n != m.n_pes():
        problems.append(f"the device sees PE {r['my_pe']} of {n}, the host PE {m.my_pe()} of {m.n_pes()} (device "
                        f"state not initialized by this module)")
    if r["complete"] != n:
        problems.append(f"{n - r['complete']} of {n} PEs' messages did not all arrive within {timeout_s:g} s (first: "
                        f"PE {r['first_missing']}, its signal word had {r['missing_low']} messages and announced "
                        f"{r['missing_high'] - 1 if r['missing_high'] else 'nothing'})")
    if r["bad_counts"] or r["bad_payloads"]:
        problems.append(f"{r['bad_counts']} wrong counts and {r['bad_payloads']} wrong messages")
    if problems:
        raise EPError(f"jax_ep.initialize: NVSHMEM device check on process {process_id}: " + "; ".join(problems))
    return r


def teardown(transport: NvshmemTransport, timeout_s: float) -> None:
    """Collective: every process meets (bounded, through the key-value store), then the groups are unregistered and
    the buffers freed. NVSHMEM and its teams stay up for the next initialize (see shutdown).

    NOTE: teams live as long as NVSHMEM in this process, cached by (start, stride, size) and reused by later
    initializes: NVSHMEM 3.4 does not give a destroyed team's slot back, so a split per initialize would exhaust
    NVSHMEM_MAX_TEAMS in a process that initializes repeatedly."""
    m = module()
    errors = []
    for nid in transport.native_ids.values():
        try:
            _native.module().group_destroy(nid)
        except Exception as e:  # keep going: the collective steps below must run on every process
            errors.append(f"destroy group {nid}: {e}")
    transport.native_ids.clear()
    agreement.barrier(transport.generation, "finalize", timeout_s)
    for axis in list(transport.buffers):
        m.free(transport.buffers.pop(axis))
    if errors:
        raise EPError("jax_ep.finalize: " + "; ".join(errors))


def shutdown(timeout_s: float | None = None) -> bool:
    """Finalizes NVSHMEM in this process (collective; at interpreter exit). Returns whether it ran.

    NOTE: jax_ep.finalize() keeps NVSHMEM up on purpose: NVSHMEM 3.x keeps its bootstrap state across
    nvshmem_finalize, so initializing it again in the same process is not a supported path. It is finalized once,
    at interpreter exit, after a bounded key-value-store barrier: if some process does not arrive (it failed, or
    exited without running its exit hooks), this process skips the NVSHMEM collective instead of hanging.
    """
    m = _process["module"]
    if m is None or not m.initialized():
        return False
    timeout_s = _process["exit_timeout_s"] if timeout_s is None else timeout_s
    try:
        agreement.barrier(-1, "nvshmem_finalize", timeout_s)
    except EPError as e:
        log.warning("jax_ep: NVSHMEM not finalized at exit (%s)", e)
        return False
    m.finalize()
    return True
