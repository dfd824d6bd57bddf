"""Agreement between the processes of a jax.distributed job, through its key-value store, before any collective.

Multi-process `jax_ep.initialize` first has every process publish a fingerprint of what it is about to set up
(configs, mesh, device -> process map, resolved backends, transport plan) and compares them all. Processes that
run different programs therefore stop with an error naming the differing field and the processes on each side,
instead of entering NVSHMEM collectives that would never match (NVSHMEM would hang or exit()). A process that never
arrives is reported after a bounded wait. Every process computes the same comparison, so all raise the same error.

Keys carry a generation number (one per multi-process initialize of this job) so finalize + initialize again
works with a fresh set of keys.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import jax

from ..errors import EPError
from .kernel_env import kernel_environment
from .kv import client

KEY_PREFIX = "jax_ep"
_MISSING = "<missing>"
_generation_lock = threading.Lock()
_generation = [0]


def key(generation: int, *parts) -> str:
    return "/".join([KEY_PREFIX, f"gen{generation}"] + [str(p) for p in parts])


def flatten(obj, prefix: str = "") -> dict:
    """{'configs[0].hidden': 2048, ...}: one entry per leaf of nested dicts / lists (for field-level diffs)."""
    out = {}
    if isinstance(obj, dict):
        for k in sorted(obj):
            out.update(flatten(obj[k], f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        out[f"{prefix}.length" if prefix else "length"] = len(obj)
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = obj
    return out


def differences(fingerprints: dict) -> list[str]:
    """'field: A on processes [..], B on processes [..]' for every field on which the processes differ."""
    flat = {pid: flatten(fp) for pid, fp in fingerprints.items()}
    fields = sorted(set().union(*(f.keys() for f in flat.values())))
    out = []
    for field in fields:
        by_value: dict[str, list[int]] = {}
        for pid in sorted(flat):
            by_value.setdefault(json.dumps(flat[pid].get(field, _MISSING)), []).append(pid)
        if len(by_value) > 1:
            sides = ", ".join(f"{json.loads(v)!r} on process{'es' if len(p) > 1 else ''} {p}"
                              for v, p in sorted(by_value.items(), key=lambda kv: kv[1]))
            out.append(f"{field}: {sides}")
    return out


def gather(generation: int, parts: tuple, record, members, process_id: int, deadline: float) -> tuple[dict, list]:
    """Publishes this process's JSON `record` under key(generation, *parts, process_id) and reads every other
    member's until `deadline`: (records by process id, the members that published none in time)."""
    c = client()
    c.key_value_set(key(generation, *parts, process_id), json.dumps(record, sort_keys=True))
    got, missing = {process_id: record}, []
    for pid in members:
        if pid == process_id:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            got[pid] = json.loads(c.blocking_key_value_get(key(generation, *parts, pid), left_ms if not missing else 1))
        except Exception:  # deadline exceeded (the error type differs between jax versions)
            missing.append(pid)
    return got, missing


def agree(generation: int, what: str, fingerprint: dict, process_id: int, num_processes: int,
          timeout_s: float) -> None:
    """Publishes this process's fingerprint and checks that every process published the same one.

    Raises EPError naming the differing fields (and which processes hold which value), or the processes that did
    not arrive within timeout_s.
    """
    got, missing = gather(generation, (what,), fingerprint, range(num_processes), process_id,
                          time.monotonic() + timeout_s)
    if missing:
        raise EPError(f"jax_ep.initialize: process{'es' if len(missing) > 1 else ''} {missing} did not reach "
                      f"jax_ep.initialize ({what}, generation {generation}) within {timeout_s:g} s (process "
                      f"{process_id} waited); every process must call jax_ep.initialize with the same mesh and "
                      f"configs (EPConfig.timeout_seconds bounds this wait)")
    diffs = differences(got)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; ... ({len(diffs) - 8} more)" if len(diffs) > 8 else "")
        raise EPError(f"jax_ep.initialize: the {num_processes} processes disagree on the setup ({what}, generation "
                      f"{generation}): {shown}. Every process must call jax_ep.initialize with the same mesh and "
                      f"configs")


def broadcast_bytes(generation: int, name: str, value: bytes | None, process_id: int, timeout_s: float) -> bytes:
    """Process 0 publishes `value`; every process returns it (the others wait at most timeout_s)."""
    c = client()
    k = key(generation, name)
    if process_id == 0:
        if value is None:
            raise EPError(f"jax_ep: process 0 has no value to broadcast for {name!r}")
        c.key_value_set_bytes(k, bytes(value))
        return bytes(value)
    try:
        return bytes(c.blocking_key_value_get_bytes(k, max(1, int(timeout_s * 1000))))
    except Exception as e:
        raise EPError(f"jax_ep: process {process_id} got no {name!r} from process 0 within {timeout_s:g} s "
                      f"({type(e).__name__}: {e})") from None


def barrier(generation: int, name: str, timeout_s: float) -> None:
    """All processes meet (bounded): EPError naming the barrier when someone does not arrive in time."""
    try:
        client().wait_at_barrier(key(generation, "barrier", name), max(1, int(timeout_s * 1000)))
    except EPError:
        raise
    except Exception as e:
        raise EPError(f"jax_ep: not every process reached {name!r} (generation {generation}) within "
                      f"{timeout_s:g} s: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# what initialize agrees on
# ---------------------------------------------------------------------------------------------------------------
def next_generation() -> int:
    """A number per multi-process initialize of this process (the same on every process of a job that calls
    initialize the same number of times, which the agreement checks by waiting on the same keys)."""
    with _generation_lock:
        _generation[0] += 1
        return _generation[0]


def current_generation() -> int:
    """The generation of this process's latest multi-process initialize (0 before any): keys of a later step of
    that same initialize (the API level's warm-up agreement) go under it."""
    with _generation_lock:
        return _generation[0]


def timeout_of(configs) -> float:
    return max(float(c.timeout_seconds) for c in configs)


def group_pes(mesh, groups) -> dict:
    """axis -> [tuple of world PEs (jax process index of each rank's device), one per EP group]."""
    owner = {int(d.id): int(d.process_index) for d in mesh.devices.flat}
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
        "kernel_env": kernel_environment(),
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("jax_ep")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source tree on sys.path)
        return "unknown"


def agree_on_setup(generation: int, mesh, configs, backends, transport: dict | None) -> None:
    """Every process checks that all processes are about to set up the same runtime (EPError naming differences)."""
    agree(generation, "initialize", fingerprint(mesh, configs, backends, transport), jax.process_index(),
          jax.process_count(), timeout_of(configs))
