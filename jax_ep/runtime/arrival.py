"""Bounded waits for the reference backend's XLA collectives across processes (docs/RELIABILITY.md).

An XLA collective (all_to_all, all_gather) across processes waits forever for a peer that stopped but is still
alive (a stalled step, a debugger, a rank that took another branch): the coordination service's heartbeat only
notices processes that died. So, in a job of several processes, every reference-backend op first meets the other
processes at an arrival point on the key-value store, bounded by the config's `timeout_seconds`:

  device d of process p, at its n-th guarded op on axis a:  publish key (a, p, n) (once per process and n), then
      wait until every other process q of the job has published (a, q, n), at most timeout_seconds in total;
      otherwise raise EPError naming the op, the process(es) that did not arrive and their ranks on the axis.

Only the other processes are waited for (never this process's own devices, whose host callbacks may run one after
the other on one thread), so an arrival never deadlocks on itself. The collective that follows synchronizes the
devices of one process with each other, so a process's devices are never more than one op apart, and a key is
deleted once it is `_KEEP` ops old. The error surfaces as the failing call's runtime error and ends this process;
`python -m jax_ep.launch` then ends the others (its supervisor stops the job when one rank exits with an error).

Assumes what SPMD programs do: every process of the job runs every op (a program that runs jax_ep ops on a subset
of the job's processes gets an arrival error instead of a hang).
"""

from __future__ import annotations

import threading
import time

from ..errors import EPError
from . import kv

_KEEP = 8  # keys of ops this many arrivals back are deleted (devices of one process are at most ~1 op apart)
_lock = threading.Lock()
_count: dict[tuple[str, int], int] = {}        # (axis, device index in the mesh) -> guarded ops it reached
_published: dict[tuple[str, int], bool] = {}   # (axis, n) -> this process published its key
_ranks_seen: dict[str, set[int]] = {}          # axis -> this process's ranks on it (published once each)


def _key(axis: str, process: int, n: int) -> str:
    return f"jax_ep/arrive/{axis}/{n}/{process}"


def _rank_key(axis: str, rank: int) -> str:
    return f"jax_ep/arrive_rank/{axis}/{rank}"


def _ranks_of(c, axis: str, process: int, num_ranks: int) -> list[int]:
    """The ranks of `process` on `axis` that ever arrived (published by that process), for the error message: one
    directory read of the published rank keys (a per-key get with a short timeout can time out on a loaded machine
    although the key is there)."""
    prefix = _rank_key(axis, 0)[:-1]
    try:
        entries = c.key_value_dir_get(prefix)
    except Exception:  # a client without directory reads, or none published yet
        entries = []
    out = []
    for key, value in entries:
        try:
            r = int(key.rsplit("/", 1)[-1])
            if 0 <= r < num_ranks and int(value) == process:
                out.append(r)
        except ValueError:
            continue
    return sorted(out)


def arrive(op: str, axis: str, timeout_s: float, device_index: int, rank: int, num_ranks: int) -> None:
    """The host side of one arrival (see the module docstring). Raises EPError on a missing process."""
    job = kv.joined_job()
    if job is None:
        return
    process, num_processes = job
    c = kv.client()
    with _lock:
        n = _count.get((axis, device_index), 0) + 1
        _count[(axis, device_index)] = n
        publish = not _published.get((axis, n), False)
        _published[(axis, n)] = True
        _published.pop((axis, n - _KEEP), None)
        new_rank = rank not in _ranks_seen.setdefault(axis, set())
        _ranks_seen[axis].add(rank)
    if new_rank:
        c.key_value_set(_rank_key(axis, rank), str(process))
    if publish:
        c.key_value_set(_key(axis, process, n), "1")
        if n > _KEEP:
            try:
                c.key_value_delete(_key(axis, process, n - _KEEP))
            except Exception:  # an old key that is already gone costs nothing
                pass
    deadline = time.monotonic() + timeout_s
    missing = []
    for q in range(num_processes):
        if q == process:
            continue
        left_ms = 1 if missing else max(1, int((deadline - time.monotonic()) * 1000))
        try:
            c.blocking_key_value_get(_key(axis, q, n), left_ms)
        except Exception:  # deadline exceeded (the error type differs between jax versions)
            missing.append(q)
    if missing:
        who = "; ".join(f"process {q} (ranks {_ranks_of(c, axis, q, num_ranks) or 'unknown'} on axis '{axis}')"
                        for q in missing)
        raise EPError(f"jax_ep.{op}: {who} did not arrive at this op (call {n} on axis '{axis}') within "
                      f"{timeout_s:g} s (EPConfig.timeout_seconds); rank {rank} (process {process}) waited. The peer "
                      f"is stalled, took another branch, or stopped; the reference backend's collectives across "
                      f"processes would wait for it forever")
