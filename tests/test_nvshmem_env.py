"""NVSHMEM transport settings (jax_ep.nvshmem_env / jax_ep.NvshmemSettings), CPU only.

The one place that decides NVSHMEM_* variables is jax_ep/runtime/nvshmem_env.py; docs/INTERNODE.md explains the
knobs. Checked here: without settings nothing changes; each field sets its NVSHMEM 3.4.5 variable; bad values name
the field; NVLS cannot be turned on; precedence (explicit setting > user variable > jax_ep default); and the
settings cannot change once NVSHMEM is up in the process.
"""

from __future__ import annotations

import sys
import types

import pytest

import jax_ep
from jax_ep import EPError, EPTypeError, NvshmemSettings
from jax_ep.runtime import nvshmem_env as ne

GiB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch):
    """Every test starts from (and leaves) the defaults, with NVSHMEM not started."""
    monkeypatch.setitem(ne._state, "settings", NvshmemSettings())
    monkeypatch.delitem(sys.modules, ne.NATIVE_MODULE, raising=False)


def _started_nvshmem(monkeypatch, up: bool = True):
    """Pretends the native NVSHMEM module is loaded and (not) initialized in this process."""
    fake = types.ModuleType(ne.NATIVE_MODULE)
    fake.initialized = lambda: up
    monkeypatch.setitem(sys.modules, ne.NATIVE_MODULE, fake)


# ---------------------------------------------------------------------------------------------------------
# defaults unchanged
# ---------------------------------------------------------------------------------------------------------
def test_public_names():
    assert jax_ep.nvshmem_env is ne.nvshmem_env and jax_ep.NvshmemSettings is ne.NvshmemSettings
    assert {"nvshmem_env", "NvshmemSettings"} <= set(jax_ep.__all__)


def test_defaults_unchanged():
    assert NvshmemSettings().environment() == {"NVSHMEM_DISABLE_NVLS": "1"}
    assert ne.current_settings() == NvshmemSettings()
    assert ne.nvshmem_environment(10 << 20, {}) == {
        "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_SYMMETRIC_SIZE": str(GiB)}
    # nvshmem_env() with no arguments stores the defaults: same result
    assert jax_ep.nvshmem_env() == NvshmemSettings()
    assert ne.nvshmem_environment(10 << 20, {}) == {
        "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_SYMMETRIC_SIZE": str(GiB)}
    # the launcher's forced values are unchanged
    assert ne.FORCED_ENV == {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}


def test_variables_are_nvshmem_345_names():
    # src/include/host/env/env_defs.h and src/modules/transport/common/env_defs.h of NVIDIA/nvshmem v3.4.5-0
    assert ne.VARIABLES == {
        "remote_transport": "NVSHMEM_REMOTE_TRANSPORT", "ibgda": "NVSHMEM_IB_ENABLE_IBGDA",
        "qps_per_pe": "NVSHMEM_IBGDA_NUM_RC_PER_PE", "qp_depth": "NVSHMEM_QP_DEPTH",
        "relaxed_ordering": "NVSHMEM_IB_ENABLE_RELAXED_ORDERING", "symmetric_size": "NVSHMEM_SYMMETRIC_SIZE"}
    assert ne.REMOTE_TRANSPORTS == ("ibrc", "ucx", "libfabric", "ibdevx", "none")


# ---------------------------------------------------------------------------------------------------------
# each field -> its variable and value
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, var, text", [
    ("remote_transport", "ibrc", "NVSHMEM_REMOTE_TRANSPORT", "ibrc"),
    ("remote_transport", "UCX", "NVSHMEM_REMOTE_TRANSPORT", "ucx"),
    ("remote_transport", "libfabric", "NVSHMEM_REMOTE_TRANSPORT", "libfabric"),
    ("remote_transport", "ibdevx", "NVSHMEM_REMOTE_TRANSPORT", "ibdevx"),
    ("remote_transport", "none", "NVSHMEM_REMOTE_TRANSPORT", "none"),
    ("ibgda", True, "NVSHMEM_IB_ENABLE_IBGDA", "1"),
    ("ibgda", False, "NVSHMEM_IB_ENABLE_IBGDA", "0"),
    ("qps_per_pe", 24, "NVSHMEM_IBGDA_NUM_RC_PER_PE", "24"),
    ("qps_per_pe", 0, "NVSHMEM_IBGDA_NUM_RC_PER_PE", "0"),
    ("qp_depth", 1024, "NVSHMEM_QP_DEPTH", "1024"),
    ("qp_depth", 128, "NVSHMEM_QP_DEPTH", "128"),
    ("qp_depth", 32768, "NVSHMEM_QP_DEPTH", "32768"),
    ("relaxed_ordering", True, "NVSHMEM_IB_ENABLE_RELAXED_ORDERING", "1"),
    ("relaxed_ordering", False, "NVSHMEM_IB_ENABLE_RELAXED_ORDERING", "0"),
    ("symmetric_size", 8 * GiB, "NVSHMEM_SYMMETRIC_SIZE", str(8 * GiB)),
    ("symmetric_size", "8G", "NVSHMEM_SYMMETRIC_SIZE", str(8 * GiB)),
    ("symmetric_size", "1536m", "NVSHMEM_SYMMETRIC_SIZE", str(1536 << 20)),
])
def test_each_field_sets_its_variable(field, value, var, text):
    s = NvshmemSettings(**{field: value})
    assert s.environment() == {"NVSHMEM_DISABLE_NVLS": "1", var: text}
    jax_ep.nvshmem_env(**{field: value})
    env = ne.nvshmem_environment(GiB // 2, {})
    assert env[var] == text and env["NVSHMEM_DISABLE_NVLS"] == "1"
    # the other knobs stay out of the environment (NVSHMEM's defaults apply)
    others = {v for f, v in ne.VARIABLES.items() if f not in (field, "remote_transport", "symmetric_size")}
    assert not others & set(env)


def test_all_fields_together_and_settings_object():
    s = NvshmemSettings(remote_transport="ibrc", ibgda=True, qps_per_pe=24, qp_depth=1024, relaxed_ordering=False,
                        symmetric_size="4G")
    want = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_IB_ENABLE_IBGDA": "1",
            "NVSHMEM_IBGDA_NUM_RC_PER_PE": "24", "NVSHMEM_QP_DEPTH": "1024",
            "NVSHMEM_IB_ENABLE_RELAXED_ORDERING": "0", "NVSHMEM_SYMMETRIC_SIZE": str(4 * GiB)}
    assert s.environment() == want
    assert ne.nvshmem_environment(GiB, {}, settings=s) == want
    # a settings object plus fields replacing some of it
    stored = jax_ep.nvshmem_env(s, qps_per_pe=9, ibgda=None)
    assert stored == ne.current_settings()
    assert stored.qps_per_pe == 9 and stored.ibgda is None and stored.remote_transport == "ibrc"
    env = ne.nvshmem_environment(GiB, {})
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "9" and "NVSHMEM_IB_ENABLE_IBGDA" not in env
    # frozen, hashable, normalized (so every process fingerprints the same value)
    with pytest.raises(Exception):
        s.qp_depth = 2048  # type: ignore[misc]
    assert NvshmemSettings(symmetric_size="4G") == NvshmemSettings(symmetric_size=4 * GiB)
    assert hash(NvshmemSettings(remote_transport="IBRC")) == hash(NvshmemSettings(remote_transport="ibrc"))


# ---------------------------------------------------------------------------------------------------------
# validation names the field
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, err, match", [
    ("remote_transport", "ibgda", EPError, r"NvshmemSettings.remote_transport='ibgda' is not an NVSHMEM remote "
                                           r"transport; expected one of ibrc, ucx, libfabric, ibdevx, none"),
    ("remote_transport", "tcp", EPError, r"NvshmemSettings.remote_transport='tcp'"),
    ("remote_transport", 1, EPTypeError, r"NvshmemSettings.remote_transport must be a str"),
    ("ibgda", 1, EPTypeError, r"NvshmemSettings.ibgda must be True, False or None"),
    ("ibgda", "yes", EPTypeError, r"NvshmemSettings.ibgda must be True, False or None"),
    ("relaxed_ordering", 0, EPTypeError, r"NvshmemSettings.relaxed_ordering must be True, False or None"),
    ("qps_per_pe", -1, EPError, r"NvshmemSettings.qps_per_pe=-1 must be >= 0"),
    ("qps_per_pe", 2.0, EPTypeError, r"NvshmemSettings.qps_per_pe must be an int"),
    ("qps_per_pe", True, EPTypeError, r"NvshmemSettings.qps_per_pe must be an int"),
    ("qp_depth", 1000, EPError, r"NvshmemSettings.qp_depth=1000 must be a power of two in \[128, 32768\]"),
    ("qp_depth", 64, EPError, r"NvshmemSettings.qp_depth=64 must be a power of two"),
    ("qp_depth", 65536, EPError, r"NvshmemSettings.qp_depth=65536 must be a power of two"),
    ("qp_depth", "1024", EPTypeError, r"NvshmemSettings.qp_depth must be an int"),
    ("symmetric_size", "1.5G", EPError, r"NvshmemSettings.symmetric_size='1.5G' is not an NVSHMEM size"),
    ("symmetric_size", 0, EPError, r"NvshmemSettings.symmetric_size=0 must be positive"),
    ("symmetric_size", 2.5, EPTypeError, r"NvshmemSettings.symmetric_size must be bytes"),
])
def test_validation_names_the_field(field, value, err, match):
    with pytest.raises(err, match=match):
        NvshmemSettings(**{field: value})
    with pytest.raises(err, match=match):
        jax_ep.nvshmem_env(**{field: value})
    assert ne.current_settings() == NvshmemSettings()  # a rejected call stores nothing


def test_nvshmem_env_arguments():
    with pytest.raises(EPTypeError, match=r"unknown setting\(s\) qp_dpeth; the settings are remote_transport, "
                                          r"ibgda, qps_per_pe, qp_depth, relaxed_ordering, symmetric_size, nvls"):
        jax_ep.nvshmem_env(qp_dpeth=1024)
    with pytest.raises(EPTypeError, match="settings must be a jax_ep.NvshmemSettings or None, got dict"):
        jax_ep.nvshmem_env({"qp_depth": 1024})


def test_errors_are_value_errors():
    # EPError is a ValueError, EPTypeError also a TypeError: callers can catch either
    with pytest.raises(ValueError):
        NvshmemSettings(qp_depth=3)
    with pytest.raises(TypeError):
        NvshmemSettings(ibgda="on")


# ---------------------------------------------------------------------------------------------------------
# NVLS cannot be enabled
# ---------------------------------------------------------------------------------------------------------
def test_nvls_cannot_be_enabled():
    for attempt in (lambda: NvshmemSettings(nvls=True), lambda: jax_ep.nvshmem_env(nvls=True),
                    lambda: jax_ep.nvshmem_env(NvshmemSettings(), nvls=1)):
        with pytest.raises(EPError, match=r"NvshmemSettings.nvls=(True|1): NVLink multicast \(NVLS\) is always off"):
            attempt()
    assert NvshmemSettings(nvls=False).environment()["NVSHMEM_DISABLE_NVLS"] == "1"
    # neither the user's environment nor any setting turns it on
    jax_ep.nvshmem_env(remote_transport="ibrc", ibgda=True)
    env = ne.nvshmem_environment(GiB, {"NVSHMEM_DISABLE_NVLS": "0"})
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"


# ---------------------------------------------------------------------------------------------------------
# precedence: explicit setting > user variable > jax_ep default
# ---------------------------------------------------------------------------------------------------------
def test_precedence_remote_transport():
    assert ne.nvshmem_environment(GiB, {})["NVSHMEM_REMOTE_TRANSPORT"] == "none"  # jax_ep default
    user = {"NVSHMEM_REMOTE_TRANSPORT": "ucx"}
    assert ne.nvshmem_environment(GiB, user)["NVSHMEM_REMOTE_TRANSPORT"] == "ucx"  # user over default
    jax_ep.nvshmem_env(remote_transport="ibrc")
    assert ne.nvshmem_environment(GiB, user)["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"  # setting over user
    jax_ep.nvshmem_env(remote_transport="none")
    assert ne.nvshmem_environment(GiB, user)["NVSHMEM_REMOTE_TRANSPORT"] == "none"


@pytest.mark.parametrize("field, var, user_value, setting, text", [
    ("ibgda", "NVSHMEM_IB_ENABLE_IBGDA", "1", False, "0"),
    ("qps_per_pe", "NVSHMEM_IBGDA_NUM_RC_PER_PE", "4", 24, "24"),
    ("qp_depth", "NVSHMEM_QP_DEPTH", "512", 2048, "2048"),
    ("relaxed_ordering", "NVSHMEM_IB_ENABLE_RELAXED_ORDERING", "0", True, "1"),
])
def test_precedence_knobs(field, var, user_value, setting, text):
    assert var not in ne.nvshmem_environment(GiB, {})  # no jax_ep default: NVSHMEM's applies
    assert ne.nvshmem_environment(GiB, {var: user_value})[var] == user_value  # the user's value passes through
    jax_ep.nvshmem_env(**{field: setting})
    assert ne.nvshmem_environment(GiB, {var: user_value})[var] == text  # an explicit setting wins
    assert ne.nvshmem_environment(GiB, {})[var] == text


def test_precedence_symmetric_size():
    need = 3 * GiB
    auto = ne.nvshmem_environment(need, {})["NVSHMEM_SYMMETRIC_SIZE"]  # jax_ep default: sized for the configs
    assert int(auto) >= need + ne.HEAP_HEADROOM_BYTES and int(auto) % ne.HEAP_ROUND_BYTES == 0
    user = {"NVSHMEM_SYMMETRIC_SIZE": "6G"}
    assert ne.nvshmem_environment(need, user)["NVSHMEM_SYMMETRIC_SIZE"] == "6G"  # user over default
    jax_ep.nvshmem_env(symmetric_size="8G")
    assert ne.nvshmem_environment(need, user)["NVSHMEM_SYMMETRIC_SIZE"] == str(8 * GiB)  # setting over user
    # an explicit size too small for the configs is an error naming both numbers (the user's one still is)
    jax_ep.nvshmem_env(symmetric_size="2G")
    with pytest.raises(EPError, match=r"jax_ep.nvshmem_env\(symmetric_size=2147483648\) is too small: these configs "
                                      r"need 3221225472 bytes of symmetric buffers plus 268435456"):
        ne.nvshmem_environment(need, {"NVSHMEM_SYMMETRIC_SIZE": "64G"})
    jax_ep.nvshmem_env()
    with pytest.raises(EPError, match=r"NVSHMEM_SYMMETRIC_SIZE=1G \(1073741824 bytes\) is too small"):
        ne.nvshmem_environment(need, {"NVSHMEM_SYMMETRIC_SIZE": "1G"})


def test_stored_settings_reach_the_transport_plan(monkeypatch):
    """The stored settings go into nvshmem.prepare's environment, which initialize compares across processes."""
    from jax_ep.runtime import nvshmem

    monkeypatch.setattr(nvshmem, "availability", lambda: "available")
    fake = types.SimpleNamespace(initialized=lambda: False)
    monkeypatch.setattr(nvshmem, "module", lambda: fake)
    jax_ep.nvshmem_env(remote_transport="ibrc", qp_depth=2048)
    info = nvshmem.prepare(1 << 20)
    assert info["error"] is None
    assert info["environment"]["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    assert info["environment"]["NVSHMEM_QP_DEPTH"] == "2048"
    assert info["max_teams"] == 32  # NVSHMEM's default: which teams initialize makes depends on it
    monkeypatch.setenv("NVSHMEM_MAX_TEAMS", "48")
    assert nvshmem.prepare(1 << 20)["max_teams"] == 48
    monkeypatch.setenv("NVSHMEM_MAX_TEAMS", "many")
    assert "NVSHMEM_MAX_TEAMS='many' is not an integer" in nvshmem.prepare(1 << 20)["error"]


# ---------------------------------------------------------------------------------------------------------
# after NVSHMEM is up: an error saying so
# ---------------------------------------------------------------------------------------------------------
def test_after_init_is_an_error(monkeypatch):
    assert not ne.nvshmem_started()
    _started_nvshmem(monkeypatch, up=False)  # module loaded, NVSHMEM not initialized yet: allowed
    assert not ne.nvshmem_started()
    jax_ep.nvshmem_env(qp_depth=2048)
    _started_nvshmem(monkeypatch, up=True)
    assert ne.nvshmem_started()
    for call in (lambda: jax_ep.nvshmem_env(qp_depth=4096), lambda: jax_ep.nvshmem_env(),
                 lambda: jax_ep.nvshmem_env(NvshmemSettings(ibgda=True))):
        with pytest.raises(EPError, match=r"NVSHMEM is already initialized in this process .* call "
                                          r"jax_ep.nvshmem_env\(\.\.\.\) before the first jax_ep.initialize"):
            call()
    assert ne.current_settings() == NvshmemSettings(qp_depth=2048)  # unchanged


def test_native_module_that_cannot_answer_is_not_started(monkeypatch):
    broken = types.ModuleType(ne.NATIVE_MODULE)

    def initialized():
        raise RuntimeError("no NVSHMEM")

    broken.initialized = initialized
    monkeypatch.setitem(sys.modules, ne.NATIVE_MODULE, broken)
    assert not ne.nvshmem_started()
    jax_ep.nvshmem_env(ibgda=False)
    assert ne.current_settings().ibgda is False


def test_native_module_name_matches_the_transport():
    from jax_ep.runtime import nvshmem

    assert nvshmem._MODULE_NAME == ne.NATIVE_MODULE


# ---------------------------------------------------------------------------------------------------------
# kernel variables (jax_ep/runtime/kernel_env.py): JAX_EP_LOW_LATENCY_PUT_BYTES
# ---------------------------------------------------------------------------------------------------------
def test_low_latency_put_bytes_default_and_valid_values():
    from jax_ep.runtime import kernel_env as ke

    assert ke.low_latency_put_bytes({}) == ke.LOW_LATENCY_PUT_BYTES_DEFAULT == 8192
    assert ke.low_latency_put_bytes({"JAX_EP_LOW_LATENCY_PUT_BYTES": " "}) == 8192
    for v in (2048, 4096, 30720, 65536):
        assert ke.low_latency_put_bytes({"JAX_EP_LOW_LATENCY_PUT_BYTES": str(v)}) == v
    assert ke.kernel_environment({"JAX_EP_LOW_LATENCY_PUT_BYTES": "8192"}) == {"JAX_EP_LOW_LATENCY_PUT_BYTES": 8192}


@pytest.mark.parametrize("raw", ["1024", "3000", "0", "-2048", "131072", "16k", "2048.0", "4_096", "+4096",
                                 "\u0664\u0660\u0669\u0666"])
def test_low_latency_put_bytes_rejects_bad_values_naming_the_variable(raw):
    from jax_ep.runtime import kernel_env as ke

    import re

    with pytest.raises(EPError, match=re.escape(f"JAX_EP_LOW_LATENCY_PUT_BYTES={raw!r} must be a multiple of 2048 from 2048 "
                                                f"to 65536")):
        ke.low_latency_put_bytes({"JAX_EP_LOW_LATENCY_PUT_BYTES": raw})


def test_initialize_rejects_a_bad_kernel_variable(monkeypatch):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    monkeypatch.setenv("JAX_EP_LOW_LATENCY_PUT_BYTES", "1000")
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    cfg = jax_ep.EPConfig(4, 64, 2, 8, backend="reference")
    with pytest.raises(EPError, match="JAX_EP_LOW_LATENCY_PUT_BYTES='1000'"):
        jax_ep.initialize(mesh, cfg)


def test_the_kernels_default_is_the_python_default():
    """The native default (nvshmem/device/low_latency.cu) and kernel_env's must be one number: a process whose
    variable is unset agrees (fingerprint) with one that sets the default explicitly."""
    import os
    import re

    from jax_ep.runtime import kernel_env as ke

    src = open(os.path.join(os.path.dirname(__file__), "..", "nvshmem", "device", "low_latency.cu")).read()
    assert int(re.search(r"constexpr int kDefaultPutPartBytes = (\d+);", src).group(1)) == ke.LOW_LATENCY_PUT_BYTES_DEFAULT


# JAX_EP_PULL_COMBINE_MIN_BYTES (one process, direct buffers): validated by initialize, not in the fingerprint
def test_pull_combine_min_bytes_default_and_valid_values():
    from jax_ep.runtime import kernel_env as ke

    assert ke.pull_combine_min_bytes({}) == ke.PULL_COMBINE_MIN_BYTES_DEFAULT == 1 << 50
    for v in ("0", "1", "4194304", str(2 ** 62 - 1)):
        assert ke.pull_combine_min_bytes({"JAX_EP_PULL_COMBINE_MIN_BYTES": v}) == int(v)
    assert "JAX_EP_PULL_COMBINE_MIN_BYTES" not in ke.kernel_environment({"JAX_EP_PULL_COMBINE_MIN_BYTES": "0"})


@pytest.mark.parametrize("raw", ["-1", " 5", "5 ", "1e6", "32M", "+7", str(2 ** 62), "\u0664"])
def test_pull_combine_min_bytes_rejects_bad_values_naming_the_variable(raw, monkeypatch):
    import re

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jax_ep.runtime import kernel_env as ke

    with pytest.raises(EPError, match=re.escape(f"JAX_EP_PULL_COMBINE_MIN_BYTES={raw!r} must be a whole number of bytes")):
        ke.pull_combine_min_bytes({"JAX_EP_PULL_COMBINE_MIN_BYTES": raw})
    monkeypatch.setenv("JAX_EP_PULL_COMBINE_MIN_BYTES", raw)
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    with pytest.raises(EPError, match="JAX_EP_PULL_COMBINE_MIN_BYTES"):
        jax_ep.initialize(mesh, jax_ep.EPConfig(4, 64, 2, 8, backend="reference"))


def test_the_pull_threshold_default_is_the_native_default():
    import os
    import re

    from jax_ep.runtime import kernel_env as ke

    src = open(os.path.join(os.path.dirname(__file__), "..", "xla_ffi", "direct_buffers.h")).read()
    m = re.search(r"constexpr int64_t kPullCombineMinBytes = int64_t\{(\d+)\} << (\d+);", src)
    assert int(m.group(1)) << int(m.group(2)) == ke.PULL_COMBINE_MIN_BYTES_DEFAULT
