"""The NVSHMEM / NCCL environment jax_ep runs with: decided here and nowhere else (a leaf module, no jax_ep imports
besides errors).

`FORCED_ENV` is set in every process jax_ep starts or initializes, whatever the parent environment says: NVLink
multicast (NVLS) must never be used on the machines this project runs on (it can take shared GPUs out of service).
The launcher forces it into its children; `nvshmem_environment` adds the NVSHMEM-only decisions (remote transport,
transport knobs, heap size) before NVSHMEM is initialized.

The transport knobs (docs/INTERNODE.md explains each one, with DeepEP's value and when to change it) are one frozen
`NvshmemSettings`; `jax_ep.nvshmem_env(...)` stores one for the next NVSHMEM init of this process. For every
variable, the value NVSHMEM is started with is, first match wins:
    1. an explicit field of the stored NvshmemSettings (not None);
    2. the variable as set in the process environment by the user;
    3. jax_ep's default (NVSHMEM_REMOTE_TRANSPORT=none, a heap sized for the configs), or else NVSHMEM's own default
       (the variable is then left unset).
NVSHMEM_DISABLE_NVLS=1 is outside that order: it is always set, and nothing can turn NVLS on.
Variable names and limits are NVSHMEM 3.4.5's: src/include/host/env/env_defs.h (NVSHMEM_REMOTE_TRANSPORT,
NVSHMEM_IB_ENABLE_IBGDA, NVSHMEM_SYMMETRIC_SIZE, NVSHMEM_DISABLE_NVLS) and src/modules/transport/common/env_defs.h
(NVSHMEM_IBGDA_NUM_RC_PER_PE, NVSHMEM_QP_DEPTH, NVSHMEM_IB_ENABLE_RELAXED_ORDERING), in NVIDIA/nvshmem tag v3.4.5-0.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading

from ..errors import EPError, EPTypeError

FORCED_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0"}

HEAP_HEADROOM_BYTES = 256 << 20  # NVSHMEM's own symmetric allocations (team psync arrays, collectives scratch)
HEAP_MIN_BYTES = 1 << 30  # NVSHMEM's default symmetric size
HEAP_ROUND_BYTES = 512 << 20

# NVSHMEM_REMOTE_TRANSPORT's values in NVSHMEM 3.4.5 (env_defs.h: "ibrc, ucx, libfabric, ibdevx, none"); IBGDA is not
# one of them: it is loaded next to the remote transport when NVSHMEM_IB_ENABLE_IBGDA=1 (host/transport/transport.cpp).
REMOTE_TRANSPORTS = ("ibrc", "ucx", "libfabric", "ibdevx", "none")
# NVSHMEM's IBGDA transport rejects a QP depth outside these bounds and rounds others up to a power of two
# (modules/transport/ibgda/ibgda.cpp; NVSHMEMI_IBGDA_MIN/MAX_QP_DEPTH in nvshmem_common_ibgda.h).
QP_DEPTH_MIN, QP_DEPTH_MAX = 128, 32768
# The separate native module that owns NVSHMEM in this process (runtime/nvshmem.py loads it under this name).
NATIVE_MODULE = "jax_ep._jax_ep_nvshmem"

# field -> the NVSHMEM variable it sets (NVLS is handled apart: always NVSHMEM_DISABLE_NVLS=1)
VARIABLES = {
    "remote_transport": "NVSHMEM_REMOTE_TRANSPORT",
    "ibgda": "NVSHMEM_IB_ENABLE_IBGDA",
    "qps_per_pe": "NVSHMEM_IBGDA_NUM_RC_PER_PE",
    "qp_depth": "NVSHMEM_QP_DEPTH",
    "relaxed_ordering": "NVSHMEM_IB_ENABLE_RELAXED_ORDERING",
    "symmetric_size": "NVSHMEM_SYMMETRIC_SIZE",
}

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgGtT]?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """NVSHMEM's size syntax: an integer with an optional binary suffix k, m, g or t ('2G', '512M', '1073741824')."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise EPError(f"jax_ep: cannot read NVSHMEM size {text!r} (expected an integer with an optional "
                                f"k/m/g/t suffix, e.g. '4G')")
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


def _where(field: str) -> str:
    return f"jax_ep.NvshmemSettings.{field}"


def _check_bool(field: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise EPTypeError(f"{_where(field)} must be True, False or None (NVSHMEM's default), got {value!r}")


def _check_int(field: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise EPTypeError(f"{_where(field)} must be an int or None (NVSHMEM's default), got {value!r}")


@dataclasses.dataclass(frozen=True)
class NvshmemSettings:
    """NVSHMEM transport knobs for one process, applied at its NVSHMEM init (docs/INTERNODE.md).

    None keeps the rule that holds without a setting: the user's environment variable if set, else jax_ep's default
    (remote_transport, symmetric_size) or NVSHMEM's (the others).
      remote_transport  NVSHMEM_REMOTE_TRANSPORT: 'ibrc' | 'ucx' | 'libfabric' | 'ibdevx' | 'none' (proxy transports
                        for remote PEs). jax_ep's default is 'none' (no NIC needed); across nodes pick one (with
                        ibgda=True, device-initiated traffic goes over IBGDA whatever this says).
      ibgda             NVSHMEM_IB_ENABLE_IBGDA: GPU-initiated InfiniBand (mlx5 NICs). NVSHMEM's default: off.
      qps_per_pe        NVSHMEM_IBGDA_NUM_RC_PER_PE: RC queue pairs per peer PE for IBGDA (>= 0; 0 = DC QPs only).
                        NVSHMEM's default 2; DeepEP: 24 (normal mode), experts per rank (low-latency mode).
      qp_depth          NVSHMEM_QP_DEPTH: work requests per QP, a power of two in [128, 32768]. Default (NVSHMEM and
                        DeepEP) 1024.
      relaxed_ordering  NVSHMEM_IB_ENABLE_RELAXED_ORDERING: PCIe relaxed ordering for NIC writes. NVSHMEM's default:
                        on.
      symmetric_size    NVSHMEM_SYMMETRIC_SIZE: bytes (int) or NVSHMEM's size syntax ('8G'); at least what the
                        configs need (checked at initialize). jax_ep's default: sized for the configs.
      nvls              NVLink multicast: always False. NVSHMEM_DISABLE_NVLS=1 is set in every case.
    Invalid values raise EPError (EPTypeError for a wrong type) naming the field.
    """

    remote_transport: str | None = None
    ibgda: bool | None = None
    qps_per_pe: int | None = None
    qp_depth: int | None = None
    relaxed_ordering: bool | None = None
    symmetric_size: int | str | None = None
    nvls: bool = False

    def __post_init__(self):
        if self.nvls is not False:
            raise EPError(f"{_where('nvls')}={self.nvls!r}: NVLink multicast (NVLS) is always off in jax_ep and cannot "
                          f"be turned on (NVSHMEM_DISABLE_NVLS=1 is set in every process)")
        if self.remote_transport is not None:
            if not isinstance(self.remote_transport, str):
                raise EPTypeError(f"{_where('remote_transport')} must be a str or None, got {self.remote_transport!r}")
            name = self.remote_transport.strip().lower()
            if name not in REMOTE_TRANSPORTS:
                raise EPError(f"{_where('remote_transport')}={self.remote_transport!r} is not an NVSHMEM remote "
                              f"transport; expected one of {', '.join(REMOTE_TRANSPORTS)} (IBGDA is enabled with "
                              f"ibgda=True, next to the remote transport)")
            object.__setattr__(self, "remote_transport", name)
        _check_bool("ibgda", self.ibgda)
        _check_bool("relaxed_ordering", self.relaxed_ordering)
        _check_int("qps_per_pe", self.qps_per_pe)
        if self.qps_per_pe is not None and self.qps_per_pe < 0:
            raise EPError(f"{_where('qps_per_pe')}={self.qps_per_pe} must be >= 0 (NVSHMEM_IBGDA_NUM_RC_PER_PE; "
                          f"0 = no RC queue pairs, DC only)")
        _check_int("qp_depth", self.qp_depth)
        if self.qp_depth is not None and not (QP_DEPTH_MIN <= self.qp_depth <= QP_DEPTH_MAX
                                              and self.qp_depth & (self.qp_depth - 1) == 0):
            raise EPError(f"{_where('qp_depth')}={self.qp_depth} must be a power of two in [{QP_DEPTH_MIN}, "
                          f"{QP_DEPTH_MAX}] (NVSHMEM_QP_DEPTH; NVSHMEM's IBGDA transport rounds other values up)")
        if self.symmetric_size is not None:
            size = self.symmetric_size
            if isinstance(size, bool) or not isinstance(size, (int, str)):
                raise EPTypeError(f"{_where('symmetric_size')} must be bytes (int), a size string like '8G', or None, "
                                  f"got {size!r}")
            if isinstance(size, str):
                try:
                    size = parse_size(size)
                except EPError:
                    raise EPError(f"{_where('symmetric_size')}={self.symmetric_size!r} is not an NVSHMEM size (an "
                                  f"integer with an optional k/m/g/t suffix, e.g. '8G')") from None
            if size <= 0:
                raise EPError(f"{_where('symmetric_size')}={self.symmetric_size!r} must be positive")
            object.__setattr__(self, "symmetric_size", int(size))

    def environment(self) -> dict:
        """The NVSHMEM_* variables these settings set: NVSHMEM_DISABLE_NVLS=1 and one per field that is not None."""
        env = {"NVSHMEM_DISABLE_NVLS": FORCED_ENV["NVSHMEM_DISABLE_NVLS"]}
        for field, var in VARIABLES.items():
            value = getattr(self, field)
            if value is not None:
                env[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return env


# ---------------------------------------------------------------------------------------------------------
# the settings stored for this process's NVSHMEM init
# ---------------------------------------------------------------------------------------------------------
_lock = threading.Lock()
_state: dict = {"settings": NvshmemSettings()}


def nvshmem_started() -> bool:
    """Whether NVSHMEM is initialized in this process (its native module is loaded and says so)."""
    native = sys.modules.get(NATIVE_MODULE)
    if native is None:
        return False
    try:
        return bool(native.initialized())
    except Exception:  # a module that cannot answer has not started NVSHMEM through jax_ep
        return False


def current_settings() -> NvshmemSettings:
    """The settings the next NVSHMEM init of this process uses (defaults unless jax_ep.nvshmem_env was called)."""
    return _state["settings"]


def nvshmem_env(settings: NvshmemSettings | None = None, **fields) -> NvshmemSettings:
    """Stores NVSHMEM transport settings for the next NVSHMEM init in this process; returns them.

    `settings` (an NvshmemSettings) with `fields` (its field names) replacing some of its values; no arguments
    restores the defaults. Call it before the first `jax_ep.initialize` that starts NVSHMEM (one process per GPU
    with the CUDA backend), with the same settings on every process (`initialize` compares them across processes).
    After NVSHMEM is up its transports are fixed for the life of the process: calling this then is an EPError.
    Precedence, per variable: an explicit setting > the user's environment variable > jax_ep's default; NVLS always
    off. Example: `jax_ep.nvshmem_env(remote_transport="ibrc", ibgda=True, qps_per_pe=24)`.
    """
    if settings is not None and not isinstance(settings, NvshmemSettings):
        raise EPTypeError(f"jax_ep.nvshmem_env: settings must be a jax_ep.NvshmemSettings or None, got "
                          f"{type(settings).__name__}")
    known = [f.name for f in dataclasses.fields(NvshmemSettings)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise EPTypeError(f"jax_ep.nvshmem_env: unknown setting(s) {', '.join(unknown)}; the settings are "
                          f"{', '.join(known)}")
    new = dataclasses.replace(settings if settings is not None else NvshmemSettings(), **fields)
    with _lock:
        if nvshmem_started():
            raise EPError("jax_ep.nvshmem_env: NVSHMEM is already initialized in this process (by an earlier "
                          "jax_ep.initialize), and its transports are fixed until the process exits; call "
                          "jax_ep.nvshmem_env(...) before the first jax_ep.initialize that starts NVSHMEM")
        _state["settings"] = new
    return new


def nvshmem_environment(required_heap_bytes: int, environ=None, settings: NvshmemSettings | None = None) -> dict:
    """The NVSHMEM_* variables jax_ep runs NVSHMEM with (applied before NVSHMEM init; part of the setup every process
    must agree on).

    `settings`: the stored ones (`jax_ep.nvshmem_env`) unless given. Per variable, first match wins: an explicit
    setting, the user's variable in `environ` (os.environ by default), jax_ep's default:
    - NVSHMEM_DISABLE_NVLS=1 always (FORCED_ENV): NVLink multicast stays off.
    - NVSHMEM_REMOTE_TRANSPORT: default none. jax_ep moves data over NVLink through nvshmem_ptr peer pointers today,
      so a remote (NIC) transport is not needed on one host, and with no NIC its init fails noisily.
    - NVSHMEM_SYMMETRIC_SIZE: default large enough for jax_ep's buffers plus NVSHMEM's own (at least NVSHMEM's
      1 GiB default); an explicit or user value smaller than what the configs need is an error naming both numbers.
    - NVSHMEM_IB_ENABLE_IBGDA, NVSHMEM_IBGDA_NUM_RC_PER_PE, NVSHMEM_QP_DEPTH, NVSHMEM_IB_ENABLE_RELAXED_ORDERING: no
      jax_ep default (NVSHMEM's applies); present in the result when set explicitly or by the user.
    Every other NVSHMEM variable is left to the user.
    """
    environ = os.environ if environ is None else environ
    settings = current_settings() if settings is None else settings
    explicit = settings.environment()
    need = int(required_heap_bytes) + HEAP_HEADROOM_BYTES
    env = {"NVSHMEM_DISABLE_NVLS": FORCED_ENV["NVSHMEM_DISABLE_NVLS"],
           "NVSHMEM_REMOTE_TRANSPORT": (explicit.get("NVSHMEM_REMOTE_TRANSPORT")
                                        or environ.get("NVSHMEM_REMOTE_TRANSPORT") or "none")}
    for field in ("ibgda", "qps_per_pe", "qp_depth", "relaxed_ordering"):
        var = VARIABLES[field]
        value = explicit.get(var) or environ.get(var)
        if value:
            env[var] = value
    if settings.symmetric_size is not None:
        if settings.symmetric_size < need:
            raise EPError(
                f"jax_ep.initialize: jax_ep.nvshmem_env(symmetric_size={settings.symmetric_size}) is too small: these "
                f"configs need {required_heap_bytes} bytes of symmetric buffers plus {HEAP_HEADROOM_BYTES} for "
                f"NVSHMEM itself = {need} bytes; raise it or leave it None (jax_ep then sizes the heap)")
        env["NVSHMEM_SYMMETRIC_SIZE"] = explicit["NVSHMEM_SYMMETRIC_SIZE"]
    elif environ.get("NVSHMEM_SYMMETRIC_SIZE"):
        user = environ["NVSHMEM_SYMMETRIC_SIZE"]
        if parse_size(user) < need:
            raise EPError(
                f"jax_ep.initialize: NVSHMEM_SYMMETRIC_SIZE={user} ({parse_size(user)} bytes) is too small: these "
                f"configs need {required_heap_bytes} bytes of symmetric buffers plus {HEAP_HEADROOM_BYTES} for "
                f"NVSHMEM itself = {need} bytes; raise it or unset it (jax_ep then sizes the heap)")
        env["NVSHMEM_SYMMETRIC_SIZE"] = user
    else:
        env["NVSHMEM_SYMMETRIC_SIZE"] = str(max(HEAP_MIN_BYTES, -(-need // HEAP_ROUND_BYTES) * HEAP_ROUND_BYTES))
    return env
