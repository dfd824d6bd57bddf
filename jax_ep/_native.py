"""Loads the native extension (jax_ep._jax_ep_native) when it was built, and registers its XLA FFI targets.

`import jax_ep` never needs the extension: `available()` says whether it loaded and `load_error()` says why not.
Registration is one loop over the module's `state_types()` (the FFI state types of the stateful handlers, which
must be known to XLA first) and one over `registrations()` (a capsule, or a dict of stage capsules for a stateful
bundle); it runs once, at the first `ensure_registered()` (called by every jax_ep.backends._ffi wrapper before it
builds an `ffi_call`, and by jax_ep.initialize), so importing jax_ep touches no backend.
"""

from __future__ import annotations

import importlib.util
import threading

_module = None
_load_error: str | None = None
try:
    from . import _jax_ep_native as _module  # type: ignore[attr-defined]
except ImportError as e:  # not built (JAX_EP_NATIVE=OFF, no CUDA toolkit at build time, ...) or broken
    _module = None
    if importlib.util.find_spec(f"{__package__}._jax_ep_native") is None:
        _load_error = ("jax_ep native extension was not built: the build found no CUDA compiler (nvcc), or ran "
                       "with JAX_EP_NATIVE=OFF, or (with --no-build-isolation) found no jaxlib or "
                       "nvidia-nvshmem-cu13; `pip install -v .` prints the reason (docs/BUILDING.md)")
    else:
        _load_error = f"jax_ep native extension failed to load: {e}"

_lock = threading.Lock()
_registered: list[tuple[str, str]] | None = None


def available() -> bool:
    """True when the native extension was built and imported."""
    return _module is not None


def load_error() -> str | None:
    """Why the extension is unavailable (None when it loaded)."""
    return _load_error


def module():
    """The extension module itself; raises ImportError with the load error when it is unavailable."""
    if _module is None:
        raise ImportError(_load_error or "jax_ep native extension not available")
    return _module


def ensure_registered() -> list[tuple[str, str]]:
    """Registers every FFI target of the extension with XLA (idempotent); returns (name, platform) pairs."""
    global _registered
    if _registered is not None:
        return _registered
    with _lock:
        if _registered is not None:
            return _registered
        import jax

        m = module()
        # NOTE: on CPU, jax.devices() must run before stateful registrations (jaxlib 0.10.2 ordering bug); harmless
        # elsewhere. A "CUDA" registration made in a process without the CUDA plugin is kept by jaxlib and harmless.
        jax.devices()
        for type_name, registration in m.state_types():
            jax.ffi.register_ffi_type(type_name, registration, platform="CUDA")
        done = []
        for name, platform, handler in m.registrations():
            jax.ffi.register_ffi_target(name, handler, platform=platform)
            done.append((name, platform))
        _registered = done
        return done


def target_name(op: str) -> str:
    """The versioned FFI target name of `op` ("dispatch", "low_latency_combine_send", ...), from the native module's
    one list (xla_ffi/registry.h). Needed to name jax_ep's custom calls, e.g. in jax.export's disabled_checks."""
    names = module().target_names()
    if op not in names:
        raise KeyError(f"jax_ep has no native target for op {op!r}; known: {sorted(names)}")
    return names[op]


def info() -> dict:
    """What was built: versions and registered targets (for logs and bug reports)."""
    if _module is None:
        return {"available": False, "load_error": _load_error}
    return {
        "available": True,
        "version": _module.version(),
        "ffi_api_version": tuple(_module.ffi_api_version()),
        "cuda_runtime_version": _module.cuda_runtime_version(),
        "targets": [(n, p) for n, p, _ in _module.registrations()],
        "state_types": [n for n, _ in _module.state_types()],
    }
