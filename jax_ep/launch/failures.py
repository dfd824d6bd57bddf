"""Which rank failed first: what a failing rank records for the launcher, and how the launcher reads it.

The launcher shares one file with its local ranks, through a descriptor they inherit (env.ENV_FAILURE_FILE); the file
has no name, so nothing is left behind however the launcher ends. Local rank i of n owns `_slot(n)` bytes at offset
i * _slot(n): its pid (written by the launcher once it has started every rank), then what its bootstrap writes, in
one pwrite, when its program fails (an uncaught exception or a non-zero exit; child.py) before the rank tears
anything down: the time (time.monotonic(), CLOCK_MONOTONIC: one clock for every process of a host) and one byte
per local rank, 1 for those that had already begun exiting (Linux /proc: PF_EXITING, a zombie, or gone). A process
is marked exiting before it closes a socket, so a rank that fails because a local peer died finds that peer exiting.

`first_failure` names, of the failed ranks, one that did not note its failure after another failed rank had begun
exiting, and of those the first by the time noted or, for a rank that noted none (killed, os._exit, a crash in
native code), by its death. Each host's launcher compares only its own ranks (a rank that fails because it lost a
peer on another host is, on its host, a rank that failed on its own).
Standard library only.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import time

_PID = struct.Struct("<q")
_NOTED = struct.Struct("<d")  # time.monotonic() when the program failed; 0.0: not failed
_PF_EXITING = 0x4  # Linux task flag, set first thing in do_exit


def _slot(n: int) -> int:
    return _PID.size + _NOTED.size + n


def create(n: int):
    """The launcher's file for `n` local ranks: an unnamed temporary file object, every slot zero."""
    f = tempfile.TemporaryFile()
    f.truncate(n * _slot(n))
    return f


def write_pids(f, pids: list[int], n: int) -> None:
    """The launcher: the pids of the local ranks it started (local rank order)."""
    for i, pid in enumerate(pids):
        os.pwrite(f.fileno(), _PID.pack(pid), i * _slot(n))


def _exiting(pid: int) -> bool:
    """Whether process `pid` has begun exiting (Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True  # exited and reaped (before the open, or between the open and the read)
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()  # after the name, which may hold spaces and parentheses
    return len(fields) > 6 and (fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING))  # state, flags


def note(fd: int, i: int, n: int) -> None:
    """Record that the program of local rank i of n (this process) failed now; the child bootstrap calls it first
    thing on failure. Errors are ignored: without a record the launcher goes by this rank's death."""
    now = time.monotonic()
    try:
        pids = [_PID.unpack(os.pread(fd, _PID.size, j * _slot(n)))[0] for j in range(n)]
        linux = sys.platform.startswith("linux")
        after = bytes(j != i and pid > 0 and linux and _exiting(pid) for j, pid in enumerate(pids))
        os.pwrite(fd, _NOTED.pack(now) + after, i * _slot(n) + _PID.size)
    except Exception:  # never in the way of the failure being reported
        pass


def read(f, ranks: list[int]) -> dict[int, tuple[float, set[int]]]:
    """{rank: (when it noted its failure, the ranks it found exiting then)} of the local ranks (`ranks`: global
    process ids in local order) that noted one."""
    n, noted = len(ranks), {}
    for i, rank in enumerate(ranks):
        slot = os.pread(f.fileno(), _slot(n), i * _slot(n))
        when = _NOTED.unpack_from(slot, _PID.size)[0]
        if when:
            noted[rank] = when, {ranks[j] for j, b in enumerate(slot[_PID.size + _NOTED.size:]) if b}
    return noted


def first_failure(noted: dict[int, tuple[float, set[int]]], deaths: dict[int, float], stop_time: float | None) -> int:
    """The rank that failed first of the failed ranks (`deaths`: rank -> when it died; `noted`: from `read`). Left
    out, unless that leaves none: a rank that noted its failure after another failed rank had begun exiting, then a
    rank that failed after the launcher began stopping the others (`stop_time`). The first of the rest by the time
    its failure was noted, or its death when it noted none."""
    when = {r: noted[r][0] if r in noted else died for r, died in deaths.items()}
    own = [r for r in deaths if not (r in noted and noted[r][1] & deaths.keys())] or list(deaths)
    own = [r for r in own if stop_time is None or when[r] < stop_time] or own
    return min(own, key=lambda r: (when[r], r))
