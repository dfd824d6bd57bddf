"""Which backend runs an op (API layer): the runtime decides reference vs cuda, the backends package holds both."""

from __future__ import annotations

from .. import backends, runtime
from .guarded_reference import GuardedReference
from ..config import LOW_LATENCY_AUTO_MAX_TOKENS, EPConfig
from ..errors import EPError
from ..runtime import kv


def backend_for(cfg: EPConfig, op: str, low_latency: bool = False):
    """The backend module for `op` on `cfg` (backends.base.Backend). On the CUDA backend this makes sure a runtime
    knows cfg first (trace-time initialize on the program's mesh, or an EPError saying to call initialize)."""
    if runtime.resolve_backend(cfg) == "reference":
        return _reference(cfg, op)
    if low_latency and not cfg.uses_low_latency_buffers():
        if cfg.backend == "auto":
            runtime.lifecycle.log_once(
                ("no-ll-buffers", cfg), "jax_ep: %s has no low-latency buffers (max_tokens_per_rank > %d and "
                "low_latency_buffers=None); low-latency ops use the reference backend", cfg,
                LOW_LATENCY_AUTO_MAX_TOKENS)
            return _reference(cfg, op)
        raise EPError(f"jax_ep.{op}: this config has no low-latency buffers (low_latency_buffers="
                      f"{cfg.low_latency_buffers}, max_tokens_per_rank={cfg.max_tokens_per_rank}; None turns them "
                      f"off above {LOW_LATENCY_AUTO_MAX_TOKENS}); pass low_latency_buffers=True to run the "
                      f"low-latency ops on the CUDA backend")
    runtime.runtime_for_trace(cfg, op)
    return backends.load_cuda()


def _reference(cfg: EPConfig, op: str):
    """The reference backend; in a job of several processes its collectives are bounded by an arrival check first
    (jax_ep/ops/guarded_reference.py)."""
    job = kv.joined_job()
    if job is not None and job[1] > 1:
        return GuardedReference(op, cfg)
    return backends.reference
