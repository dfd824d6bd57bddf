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
