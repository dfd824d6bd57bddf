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

import json
import time

from .validation import EPError

KEY_PREFIX = "jax_ep"
_MISSING = "<missing>"


def client():
    """The jax.distributed client (key-value store, barriers); EPError when the job has none."""
    from jax._src import distributed

    c = distributed.global_state.client
    if c is None:
        raise EPError("jax_ep: several JAX processes but no jax.distributed client; call jax.distributed.initialize "
                      "(python -m jax_ep.launch + jax_ep.launch.init_from_env() do) before jax_ep.initialize")
    return c


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


def agree(generation: int, what: str, fingerprint: dict, process_id: int, num_processes: int,
          timeout_s: float) -> None:
    """Publishes this process's fingerprint and checks that every process published the same one.

    Raises EPError naming the differing fields (and which processes hold which value), or the processes that did
    not arrive within timeout_s.
    """
    c = client()
    mine = json.dumps(fingerprint, sort_keys=True)
    c.key_value_set(key(generation, what, process_id), mine)
    deadline = time.monotonic() + timeout_s
    got, missing = {process_id: fingerprint}, []
    for pid in range(num_processes):
        if pid == process_id:
            continue
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            got[pid] = json.loads(c.blocking_key_value_get(key(generation, what, pid), left_ms if not missing else 1))
        except Exception:  # deadline exceeded (the error type differs between jax versions)
            missing.append(pid)
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
