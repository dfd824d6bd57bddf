"""Receive pools: direct receive with one process per GPU.

A dispatch takes direct receive when the peers can store into the receiver's outputs. In one process every device
maps them; with one process per GPU each process maps the memory pool XLA allocates from (XLA's preallocated pool,
one exportable allocation) of every other process of its EP group, once, at `jax_ep.initialize`:

1. each process exports its pool as a file descriptor (xla_ffi/receive_pools.h) and publishes, through the job's
   key-value store, whether it could, with the name of a Unix socket (abstract namespace) that hands the descriptor
   out, only to the processes of the group (their pids and this user, as the kernel reports the connecting process);
2. if every process of the group could, each receives every peer's descriptor over that socket, maps the pool and
   checks it through a probe array the exporter placed in it; each publishes where it mapped every peer's pool;
3. if every process mapped every pool, each registers its pool and the displacements with its group
   (`group_set_receive_pool`); otherwise none does, and the group's dispatches receive through staging.

Every process of the group reaches the same outcome (each step decides on what every process published). The mappings
stay until the process exits. XLA's preallocation off (`XLA_PYTHON_CLIENT_PREALLOCATE=false`) leaves no pool: buffers
then come from mappings XLA makes as it grows, which no peer mapped.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid

import numpy as np

from . import agreement
from .. import _native
from ..config import MAX_NVL_PEERS
from ..errors import EPError

PROBE_BYTES = 64
SOCKET_SECONDS = 30.0  # the longest the descriptors' hand-over may take (a healthy one: well under a second)
log = logging.getLogger("jax_ep")


def _pool_bytes(device) -> int | None:
    """The size of XLA's memory pool on `device` as XLA reports it, or None."""
    stats = device.memory_stats() or {}
    got = stats.get("pool_bytes") or stats.get("bytes_limit")
    return int(got) if got else None


def _local_reason(group_size: int, unmapped: list) -> str | None:
    """Why this process cannot offer its pool before looking at it, or None."""
    if not _native.module().direct_buffers_enabled():
        return "direct buffers are off in this process (JAX_EP_DIRECT_BUFFERS=0)"
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0"):
        return "XLA's preallocation is off (XLA_PYTHON_CLIENT_PREALLOCATE=false): no pool to map"
    allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
    if allocator not in ("default", "bfc"):
        return f"XLA_PYTHON_CLIENT_ALLOCATOR={allocator}: no preallocated pool to map"
    if unmapped:
        return f"ranks {unmapped} are on other hosts"
    if group_size > MAX_NVL_PEERS:
        return f"the group has {group_size} ranks (at most {MAX_NVL_PEERS} share one host's NVLink kernels)"
    return None


def _offer(device, listeners: int):
    """(record, fd, listener, probe): this process's pool exported, a socket to hand it out, and the probe array
    placed in it; or a record saying why not (fd -1, no listener)."""
    probe_bytes = os.urandom(PROBE_BYTES)
    fd, listener = -1, None
    try:
        import jax

        probe = jax.device_put(np.frombuffer(probe_bytes, np.uint8), device)
        probe.block_until_ready()
        ptr = probe.unsafe_buffer_pointer()
        fd, base, size = _native.module().receive_pool_export(ptr)
        pool = _pool_bytes(device)
        # the mapping must be XLA's whole preallocated pool, which XLA never unmaps; a mapping of its own per buffer
        # (another allocator) would be freed with the probe while the peers still map it
        if pool is None or size < 0.9 * pool:
            raise RuntimeError(f"the probe's mapping ({size} bytes) is not XLA's pool ({pool} bytes)")
        name = f"\0jax_ep_receive_pool_{uuid.uuid4().hex}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(name)
        listener.listen(listeners)
        return ({"ok": True, "why": None, "pid": os.getpid(), "base": base, "bytes": size, "probe_offset": ptr - base,
                 "probe": probe_bytes.hex(), "socket": name}, fd, listener, probe)
    except Exception as e:  # any local failure turns pools off for the group, never leaves the peers waiting
        if fd >= 0:
            os.close(fd)
        if listener is not None:
            listener.close()
        return {"ok": False, "why": f"XLA's pool cannot be offered: {e}"}, -1, None, None


def _gather(generation: int, step: str, axis: str, record: dict, pes: tuple, process_id: int,
            deadline: float) -> dict:
    """Publishes this process's record of `step` and returns every member's, by PE; EPError naming the members that
    published none by `deadline`."""
    got, missing = agreement.gather(generation, ("receive_pool", step, axis), record, pes, process_id, deadline)
    if missing:
        raise EPError(f"jax_ep.initialize: process{'es' if len(missing) > 1 else ''} "
                      f"{', '.join(map(str, missing))} published no receive pool ({step}, axis {axis!r}) within the "
                      f"timeout")
    return got


def _serve(listener: socket.socket, fd: int, peers: set, errors: list, until: float) -> None:
    """Hands `fd` to one connection from each process id in `peers` (pids, as SO_PEERCRED reports them) until
    `until`; a connection from any other process, or of another user, gets nothing."""
    left = set(peers)
    try:
        while left and time.monotonic() < until:
            listener.settimeout(max(0.01, until - time.monotonic()))
            conn, _ = listener.accept()
            with conn:
                pid, uid, _gid = struct.unpack("iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                      struct.calcsize("iII")))
                if pid not in left or uid != os.getuid():
                    log.warning("jax_ep.initialize: process %d (uid %d), not of this EP group, asked for this "
                                "process's receive pool; refused", pid, uid)
                    continue
                socket.send_fds(conn, [b"p"], [fd])
                left.discard(pid)
    except TimeoutError:  # `until` passed with peers left: said below
        pass
    except OSError as e:
        errors.append(f"handing out the pool: {e}")
    if left:
        errors.append(f"processes with pids {sorted(left)} did not take this process's pool in time")


def _fetch(peer: dict, until: float) -> int:
    """The descriptor of a peer's pool, from its socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(max(0.01, until - time.monotonic()))
        s.connect(peer["socket"])
        _, fds, _, _ = socket.recv_fds(s, 16, 1)
    if not fds:
        raise OSError("no descriptor received (refused by the peer)")
    return fds[0]


def _map_peers(offered: dict, peers: list, device_ordinal: int, until: float, errors: list) -> dict:
    """Fetches every peer's descriptor (each peer in turn, whatever failed before, so every server finishes), then
    maps the pools one after another. Returns {str(pe): where this process maps pe's pool}."""
    fds: dict = {}
    for pe in peers:
        try:
            fds[pe] = _fetch(offered[pe], until)
        except OSError as e:
            errors.append(f"fetching the pool of process {pe}: {e}")
    mapped: dict = {}
    for pe, fd in fds.items():
        peer = offered[pe]
        try:
            mapped[str(pe)] = _native.module().receive_pool_import(
                fd, peer["pid"], peer["base"], peer["bytes"], device_ordinal, peer["probe_offset"],
                bytes.fromhex(peer["probe"]))
        except RuntimeError as e:
            errors.append(f"mapping the pool of process {pe}: {e}")
        finally:
            os.close(fd)
    return mapped


def _first_off(records: dict) -> str | None:
    for pe, r in sorted(records.items()):
        if not r["ok"]:
            return f"process {pe}: {r['why']}"
    return None


def connect(*, generation: int, axis: str, native_id: int, pes: tuple, process_id: int, device,
            device_ordinal: int, unmapped: list, timeout_s: float) -> str:
    """Collective over the processes in `pes` (rank order): maps every member's pool into every other member and
    registers this rank's pool with group `native_id`. Returns "on" or "off: <why>" (the same on every member)."""
    deadline = time.monotonic() + timeout_s
    # the socket steps end here: time is left for the mapping and the last exchange, and a peer that cannot fetch
    # (refused: another pid namespace) costs at most SOCKET_SECONDS
    until = min(deadline - min(10.0, timeout_s / 4), time.monotonic() + SOCKET_SECONDS)
    why = _local_reason(len(pes), unmapped)
    record, fd, listener, probe = ({"ok": False, "why": why}, -1, None, None) if why else _offer(device, len(pes))
    server, errors = None, []
    try:
        offered = _gather(generation, "offer", axis, record, pes, process_id, deadline)
        off = _first_off(offered)
        if off is not None:
            return f"off: {off}"
        peers = [pe for pe in pes if pe != process_id]
        server = threading.Thread(target=_serve, args=(listener, fd, {offered[pe]["pid"] for pe in peers}, errors,
                                                       until), daemon=True)
        server.start()
        mapped = _map_peers(offered, peers, device_ordinal, until, errors)
        server.join(max(0.0, until - time.monotonic()) + 1.0)  # serving ends at `until`; errors is complete after it
        done = _gather(generation, "mapped", axis, {"ok": not errors, "why": "; ".join(errors), "local": mapped},
                       pes, process_id, deadline)
        off = _first_off(done)
        if off is not None:
            return f"off: {off}"
        delta = [0 if pe == process_id else done[pe]["local"][str(process_id)] - record["base"] for pe in pes]
        _native.module().group_set_receive_pool(native_id, record["base"], record["bytes"], delta)
        return "on"
    finally:
        if server is not None:  # it may still hand out fd: only then is fd closed
            server.join(max(0.0, until - time.monotonic()) + 1.0)
        if fd >= 0:
            os.close(fd)
        if listener is not None:
            listener.close()
        del probe  # kept until every peer checked it (the "mapped" step)
