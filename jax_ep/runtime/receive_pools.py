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

import json
import os
import socket
import struct
import threading
import time
import uuid

import numpy as np

from . import agreement
from .. import _native
from ..errors import EPError

PROBE_BYTES = 64


def _local_reason(group_size: int, unmapped: list) -> str | None:
    """Why this process cannot offer its pool, or None."""
    if not _native.module().direct_buffers_enabled():
        return "direct buffers are off in this process (JAX_EP_DIRECT_BUFFERS=0)"
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0"):
        return "XLA's preallocation is off (XLA_PYTHON_CLIENT_PREALLOCATE=false): no pool to map"
    if unmapped:
        return f"ranks {unmapped} are on other hosts"
    if group_size > 8:
        return f"the group has {group_size} ranks (at most 8 share one host's NVLink kernels)"
    return None


def _gather(generation: int, step: str, axis: str, record: dict, pes: tuple, process_id: int,
            deadline: float) -> dict:
    """Publishes this process's record of `step` and returns every member's, by PE."""
    c = agreement.client()
    c.key_value_set(agreement.key(generation, "receive_pool", step, axis, process_id), json.dumps(record))
    got = {process_id: record}
    for pe in pes:
        if pe == process_id:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            got[pe] = json.loads(c.blocking_key_value_get(agreement.key(generation, "receive_pool", step, axis, pe),
                                                          left_ms))
        except Exception as e:  # deadline exceeded (the error type differs between jax versions)
            raise EPError(f"jax_ep.initialize: process {pe} published no receive pool ({step}, axis {axis!r}) "
                          f"within the timeout ({type(e).__name__})") from None
    return got


def _serve(listener: socket.socket, fd: int, peers: set, errors: list) -> None:
    """Hands `fd` to one connection from each process id in `peers` (pids, as SO_PEERCRED reports them): a
    connection from any other process, or of another user, gets nothing and is an error (no pools anywhere)."""
    try:
        for _ in range(len(peers)):
            conn, _ = listener.accept()
            with conn:
                pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                     struct.calcsize("3i")))
                if pid not in peers or uid != os.getuid():
                    errors.append(f"process {pid} (uid {uid}), not of this group, asked for this process's pool")
                    continue
                peers = peers - {pid}
                socket.send_fds(conn, [b"p"], [fd])
    except OSError as e:
        errors.append(f"handing out the pool: {e}")


def _first_off(records: dict) -> str | None:
    for pe, r in sorted(records.items()):
        if not r["ok"]:
            return f"process {pe}: {r['why']}"
    return None


def connect(*, generation: int, axis: str, native_id: int, pes: tuple, process_id: int, device,
            device_ordinal: int, unmapped: list, timeout_s: float) -> str:
    """Collective over the processes in `pes` (rank order): maps every member's pool into every other member and
    registers this rank's pool with group `native_id`. Returns "on" or "off: <why>" (the same on every member)."""
    import jax

    deadline = time.monotonic() + timeout_s
    why = _local_reason(len(pes), unmapped)
    fd, listener, probe = -1, None, None
    record = {"ok": False, "why": why}
    try:
        if why is None:
            probe_bytes = os.urandom(PROBE_BYTES)
            probe = jax.device_put(np.frombuffer(probe_bytes, np.uint8), device)
            probe.block_until_ready()
            ptr = probe.unsafe_buffer_pointer()
            try:
                fd, base, size = _native.module().receive_pool_export(ptr)
            except RuntimeError as e:
                record["why"] = f"XLA's pool cannot be exported: {e}"
            else:
                name = f"\0jax_ep_receive_pool_{uuid.uuid4().hex}"
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(name)
                listener.listen(len(pes))
                listener.settimeout(max(1.0, deadline - time.monotonic()))
                record = {"ok": True, "why": None, "pid": os.getpid(), "base": base, "bytes": size,
                          "probe_offset": ptr - base, "probe": probe_bytes.hex(), "socket": name}
        offered = _gather(generation, "offer", axis, record, pes, process_id, deadline)
        off = _first_off(offered)
        if off is not None:
            return f"off: {off}"

        errors: list = []
        peer_pids = {offered[pe]["pid"] for pe in pes if pe != process_id}
        server = threading.Thread(target=_serve, args=(listener, fd, peer_pids, errors), daemon=True)
        server.start()
        mapped: dict = {}
        for pe in pes:
            if pe == process_id:
                continue
            peer = offered[pe]
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(max(1.0, deadline - time.monotonic()))
                    s.connect(peer["socket"])
                    _, fds, _, _ = socket.recv_fds(s, 16, 1)
                if not fds:
                    raise OSError("no descriptor received")
                try:
                    mapped[str(pe)] = _native.module().receive_pool_import(
                        fds[0], peer["pid"], peer["base"], peer["bytes"], device_ordinal, peer["probe_offset"],
                        bytes.fromhex(peer["probe"]))
                finally:
                    for f in fds:
                        os.close(f)
            except (OSError, RuntimeError) as e:
                errors.append(f"mapping the pool of process {pe}: {e}")
                break
        server.join(max(0.0, deadline - time.monotonic()))
        if server.is_alive():
            errors.append("a peer did not take this process's pool in time")
        done = _gather(generation, "mapped", axis, {"ok": not errors, "why": "; ".join(errors), "local": mapped},
                       pes, process_id, deadline)
        off = _first_off(done)
        if off is not None:
            return f"off: {off}"
        delta = [0 if pe == process_id else done[pe]["local"][str(process_id)] - record["base"] for pe in pes]
        _native.module().group_set_receive_pool(native_id, record["base"], record["bytes"], delta)
        return "on"
    finally:
        if fd >= 0:
            os.close(fd)
        if listener is not None:
            listener.close()
        del probe  # kept until every peer checked it (the "mapped" step)
