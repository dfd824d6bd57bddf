"""jax_ep/runtime/receive_pools.py on the CPU: who gets a pool's descriptor, and the outcome every process of a group
reaches. The driver calls (export, import, registration) are replaced by a recording fake; the GPU suite maps real
pools (tests/gpu/test_multiprocess_cuda.py, the case with pools)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import uuid

import jax
import pytest

from jax_ep.errors import EPError
from jax_ep.runtime import agreement, receive_pools


def _listener():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0jax_ep_test_{uuid.uuid4().hex}"
    s.bind(name)
    s.listen(4)
    s.settimeout(10)
    return s, name


def _fetch(name):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(10)
        c.connect(name)
        _, fds, _, _ = socket.recv_fds(c, 16, 1)
    return fds


def test_serve_hands_the_descriptor_to_a_process_of_the_group():
    listener, name = _listener()
    with tempfile.TemporaryFile() as f, listener:
        f.write(b"pool bytes")
        f.flush()
        errors: list = []
        t = threading.Thread(target=receive_pools._serve,
                             args=(listener, f.fileno(), {os.getpid()}, errors, time.monotonic() + 10))
        t.start()
        fds = _fetch(name)
        t.join(10)
        assert not t.is_alive() and errors == []
        assert len(fds) == 1
        with os.fdopen(fds[0], "rb") as got:  # the same open file: reads what was written through f
            got.seek(0)
            assert got.read() == b"pool bytes"


def test_serve_refuses_a_process_outside_the_group():
    listener, name = _listener()
    with tempfile.TemporaryFile() as f, listener:
        errors: list = []
        stranger = os.getpid() + 1  # the group's only pid is not this process's
        t = threading.Thread(target=receive_pools._serve,
                             args=(listener, f.fileno(), {stranger}, errors, time.monotonic() + 1.0))
        t.start()
        assert _fetch(name) == []  # this process is refused: no descriptor
        t.join(10)
        assert not t.is_alive()
        assert errors == [f"processes with pids [{stranger}] did not take this process's pool in time"], errors


class _FakeClient:
    """The key-value calls receive_pools makes, over a dict."""

    def __init__(self):
        self.kv: dict = {}

    def key_value_set(self, k, v):
        self.kv[k] = v

    def blocking_key_value_get(self, k, timeout_ms):
        if k not in self.kv:
            raise TimeoutError(k)
        return self.kv[k]


class _FakeNative:
    def __init__(self, export_error=None):
        self.export_error, self.registered, self.exported = export_error, [], []

    def direct_buffers_enabled(self):
        return True

    def receive_pool_export(self, ptr):
        if self.export_error:
            raise RuntimeError(self.export_error)
        r, w = os.pipe()
        os.close(w)
        self.exported.append(ptr)
        return r, ptr - 4096, 1 << 20

    def group_set_receive_pool(self, native_id, begin, nbytes, delta):
        self.registered.append((native_id, begin, nbytes, list(delta)))


@pytest.fixture
def fakes(monkeypatch):
    client = _FakeClient()
    monkeypatch.setattr(agreement, "client", lambda: client)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    monkeypatch.setattr(receive_pools, "_pool_bytes", lambda device: 1 << 20)  # the fake export's mapping size
    return client


def _connect(native, monkeypatch, **kw):
    monkeypatch.setattr(receive_pools._native, "module", lambda: native)
    args = dict(generation=7, axis="ep", native_id=3, pes=(0,), process_id=0, device=jax.devices()[0],
                device_ordinal=0, unmapped=[], timeout_s=5)
    args.update(kw)
    return receive_pools.connect(**args)


def test_a_group_of_one_registers_its_pool(fakes, monkeypatch):
    native = _FakeNative()
    assert _connect(native, monkeypatch) == "on"
    (ptr,) = native.exported
    assert native.registered == [(3, ptr - 4096, 1 << 20, [0])]
    offer = json.loads(fakes.kv[agreement.key(7, "receive_pool", "offer", "ep", 0)])
    assert offer["ok"] and offer["pid"] == os.getpid() and offer["probe_offset"] == 4096, offer


@pytest.mark.parametrize("setup,why", [
    (dict(env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}), "XLA's preallocation is off"),
    (dict(unmapped=[1]), "ranks [1] are on other hosts"),
    (dict(env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}), "XLA_PYTHON_CLIENT_ALLOCATOR=platform"),
    (dict(export_error="allows no POSIX file descriptor"), "XLA's pool cannot be offered: allows no POSIX"),
    (dict(pool_bytes=4 << 20), "the probe's mapping (1048576 bytes) is not XLA's pool (4194304 bytes)"),
])
def test_a_process_that_cannot_offer_its_pool_turns_pools_off(fakes, monkeypatch, setup, why):
    for k, v in setup.get("env", {}).items():
        monkeypatch.setenv(k, v)
    if "pool_bytes" in setup:  # a mapping of its own per buffer, not XLA's pool: freed with the probe
        monkeypatch.setattr(receive_pools, "_pool_bytes", lambda device: setup["pool_bytes"])
    native = _FakeNative(setup.get("export_error"))
    got = _connect(native, monkeypatch, unmapped=setup.get("unmapped", []))
    assert got.startswith("off: process 0: ") and why in got, got
    assert native.registered == []


def test_every_member_reaches_the_same_outcome(fakes, monkeypatch):
    """Process 0 of a two-process group sees process 1 offer no pool: neither registers one."""
    fakes.kv[agreement.key(7, "receive_pool", "offer", "ep", 1)] = json.dumps(
        {"ok": False, "why": "XLA's preallocation is off"})
    native = _FakeNative()
    got = _connect(native, monkeypatch, pes=(0, 1))
    assert got == "off: process 1: XLA's preallocation is off" and native.registered == []


def test_a_member_that_never_offers_is_an_error_naming_it(fakes, monkeypatch):
    with pytest.raises(EPError, match="process 1 published no receive pool"):
        _connect(_FakeNative(), monkeypatch, pes=(0, 1), timeout_s=0.2)


class _BlockingClient(_FakeClient):
    """The key-value store shared by the members of a group (threads here), whose gets wait for the key."""

    def __init__(self):
        super().__init__()
        self.cv = threading.Condition()

    def key_value_set(self, k, v):
        with self.cv:
            self.kv[k] = v
            self.cv.notify_all()

    def blocking_key_value_get(self, k, timeout_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: k in self.kv, timeout_ms / 1000):
                raise TimeoutError(k)
            return self.kv[k]


class _GroupNative(_FakeNative):
    """Every member's driver layer (members are threads named m0, m1, ...): member m's pool starts at (m + 1) << 32,
    and member m maps member p's pool at ((m + 1) << 40) + (p << 32). import_fails: members whose imports raise."""

    def __init__(self, import_fails=()):
        super().__init__()
        self.import_fails, self.imports = set(import_fails), []

    @staticmethod
    def member():
        return int(threading.current_thread().name[1:])

    def receive_pool_export(self, ptr):
        r, w = os.pipe()
        os.close(w)
        return r, (self.member() + 1) << 32, 1 << 20

    def receive_pool_import(self, fd, pid, base, nbytes, ordinal, probe_offset, expect):
        os.fstat(fd)  # a descriptor that is open in this process
        m, p = self.member(), (base >> 32) - 1
        self.imports.append((m, p, pid, nbytes, len(expect)))
        if m in self.import_fails:
            raise RuntimeError("cuMemMap failed with CUresult 2")
        return ((m + 1) << 40) + (p << 32)

    def group_set_receive_pool(self, native_id, begin, nbytes, delta):
        self.registered.append((self.member(), begin, nbytes, list(delta)))


def _run_group(native, monkeypatch, members=2, timeout_s=10.0):
    client = _BlockingClient()
    monkeypatch.setattr(agreement, "client", lambda: client)
    monkeypatch.setattr(receive_pools._native, "module", lambda: native)
    monkeypatch.setattr(receive_pools, "_pool_bytes", lambda device: 1 << 20)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    got: dict = {}

    def member(m):
        try:
            got[m] = receive_pools.connect(generation=1, axis="ep", native_id=9, pes=tuple(range(members)),
                                           process_id=m, device=jax.devices()[0], device_ordinal=0, unmapped=[],
                                           timeout_s=timeout_s)
        except Exception as e:  # a member that raises shows up in the result
            got[m] = f"raised {e}"

    threads = [threading.Thread(target=member, args=(m,), name=f"m{m}") for m in range(members)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return got, time.monotonic() - t0


def test_members_map_each_other_and_register_the_displacements(monkeypatch):
    """Two members (threads of this process: one pid, which _serve hands out to once, as to one process)."""
    native = _GroupNative()
    got, _ = _run_group(native, monkeypatch, members=2)
    assert got == {0: "on", 1: "on"}, got
    assert sorted((m, p) for m, p, *_ in native.imports) == [(0, 1), (1, 0)]
    assert all(pid == os.getpid() and n == 1 << 20 and probe == receive_pools.PROBE_BYTES
               for _, _, pid, n, probe in native.imports)
    # member m: delta[d] = where d maps m's pool - where m has it
    want = {m: [0 if d == m else ((d + 1) << 40) + (m << 32) - ((m + 1) << 32) for d in range(2)] for m in range(2)}
    assert {m: delta for m, _, _, delta in native.registered} == want
    assert {m: begin for m, begin, _, _ in native.registered} == {m: (m + 1) << 32 for m in range(2)}


def test_a_member_that_cannot_map_turns_pools_off_everywhere_without_waiting_out_the_timeout(monkeypatch):
    native = _GroupNative(import_fails={1})
    got, seconds = _run_group(native, monkeypatch, members=2, timeout_s=20.0)
    assert got[0] == got[1] and got[0].startswith("off: process 1: mapping the pool of process 0: cuMemMap"), got
    assert native.registered == []
    assert seconds < 10, seconds  # not the 20 s timeout: every member learns of the failure from the "mapped" step


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("stats,want", [(None, None), ({}, None), ({"pool_bytes": 0, "bytes_limit": 5}, 5),
                                        ({"pool_bytes": 7, "bytes_limit": 5}, 7)])
def test_pool_bytes_reads_xla_s_memory_stats(stats, want):
    assert receive_pools._pool_bytes(_Device(stats)) == want


def test_local_reasons(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    native = _FakeNative()
    monkeypatch.setattr(receive_pools._native, "module", lambda: native)
    assert receive_pools._local_reason(8, []) is None
    assert "9 ranks" in receive_pools._local_reason(9, [])
    native.direct_buffers_enabled = lambda: False
    assert "JAX_EP_DIRECT_BUFFERS=0" in receive_pools._local_reason(2, [])
