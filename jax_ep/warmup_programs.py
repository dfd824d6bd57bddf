"""`jax_ep.initialize`: the runtime's setup (runtime/lifecycle.py), then one execution of every kernel family each
new config uses, before the user's first call.

For each new CUDA config, one jitted `shard_map` program over the runtime's mesh runs a normal-mode dispatch +
combine at the config's largest shapes (T = max_tokens_per_rank tokens per rank, routed to K distinct experts so
every transport leg moves rows: NVLink stores, NVSHMEM puts, forwarders), and, when the config has low-latency
buffers, a low-latency dispatch (fp8 when H allows it) + combine. Its inputs are made inside the program (iota),
so nothing crosses the host.

What it warms (issue 14, item 1): every kernel of those ops runs once (launch paths, NVSHMEM's first device-side
use, the op state of each handler), and XLA's allocator grows to the size of those outputs, which it keeps for the
user's program (with XLA_PYTHON_CLIENT_PREALLOCATE=false that growth was most of the first call's excess, docs/
BENCHMARKS.md, "Prewarm"). What it cannot warm: the first execution of the user's own executable (loading its
module, recording its CUDA graph): `jax_ep.warmup(compiled, *args)` runs that one.

Collective: every process runs the same programs in the same order (initialize is collective). The ops see the
runtime through runtime_for_trace, so the programs run after the runtime is installed; the trace-time initialize of
runtime_for_trace never runs them (no program executes while another is being traced). This module sits at the API
level (it runs the ops; runtime/ never imports them, docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import runtime
from .config import EPConfig
from .errors import EPError

log = logging.getLogger("jax_ep")


def _routing(cfg: EPConfig, rank):
    """[T, K] int32: token t of rank r to experts (t*K + k + r) mod E, K distinct experts per token (K <= E)."""
    t = jax.lax.broadcasted_iota(jnp.int32, (cfg.max_tokens_per_rank, cfg.num_topk), 0)
    k = jax.lax.broadcasted_iota(jnp.int32, (cfg.max_tokens_per_rank, cfg.num_topk), 1)
    return (t * cfg.num_topk + k + rank) % cfg.num_experts


def _body(cfg: EPConfig, low_latency: bool):
    """The per-shard program: returns a [1] f32 that depends on every op's output (nothing is dead code)."""
    from . import ops_low_latency, ops_normal

    def body():
        rank = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
        T, H, K = cfg.max_tokens_per_rank, cfg.hidden, cfg.num_topk
        x = jnp.ones((T, H), jnp.bfloat16)
        idx = _routing(cfg, rank)
        w = jnp.full((T, K), 1.0 / K, jnp.float32)
        out = ops_normal.dispatch(x, idx, w, cfg)
        y, _ = ops_normal.combine(out.recv_x, out.handle, cfg)
        acc = y[0, 0].astype(jnp.float32) + out.num_recv_tokens.astype(jnp.float32)
        if low_latency:
            ll = ops_low_latency.low_latency_dispatch(x, idx, cfg, use_fp8=H % 128 == 0)
            expert_out = jnp.zeros(ll.recv_x.shape, jnp.bfloat16)
            y_ll = ops_low_latency.low_latency_combine(expert_out, idx, w, ll.handle, cfg)
            acc = acc + y_ll[0, 0].astype(jnp.float32) + ll.recv_count[0].astype(jnp.float32)
        return acc.reshape(1)

    return body


def _warm_up_program(mesh: jax.sharding.Mesh, cfg: EPConfig, low_latency: bool):
    """The compiled warm-up program of cfg on mesh (no arguments; a [devices] f32 output, one entry per shard:
    y[0, 0] + num_recv_tokens of the normal ops, plus y[0, 0] + recv_count[0] of the low-latency ops)."""
    body = _body(cfg, low_latency)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(tuple(mesh.axis_names)))).lower().compile()


def _warm_up_programs(mesh: jax.sharding.Mesh, configs) -> dict[str, float]:
    """Runs one warm-up program per config (collective) and returns {"warmup_execution": seconds} (empty when
    `configs` is empty). A config whose ops refuse it at trace time (an EPError or ValueError: a shape or mode
    the ops do not support) is skipped with a log line, since initialize has nothing to warm for ops it cannot
    run; an error while the program runs (a kernel that traps, a missing peer) propagates."""
    if not configs:
        return {}
    t0 = time.perf_counter()
    for cfg in configs:
        compiled = None
        for low_latency in ((True, False) if cfg.uses_low_latency_buffers() else (False,)):
            try:  # trace-time refusals are the same on every process, so every process picks the same program
                compiled = _warm_up_program(mesh, cfg, low_latency)
                break
            except (EPError, ValueError, TypeError) as e:
                log.info("jax_ep.initialize: no warm-up program (low-latency ops %s) for %s: %s",
                         "included" if low_latency else "excluded", cfg, e)
        if compiled is not None:
            jax.block_until_ready(compiled())
    return {"warmup_execution": time.perf_counter() - t0}


def initialize(mesh: jax.sharding.Mesh, *configs: EPConfig, warmup: bool = True, **kwargs) -> runtime.Runtime:
    """The prewarm hook: eager, before tracing; idempotent for the same (mesh, configs); collective with several
    processes.

    Sets up, for every config on the CUDA backend, the transport (buffers, peer access or NVSHMEM, teams), binds
    the mesh axes for the kernels and runs one warm-up exchange (runtime.initialize). Then, with warmup=True (the
    default), one execution per config new to the runtime of a program with a normal-mode dispatch + combine at the
    config's largest shapes, and a low-latency dispatch + combine when the config has low-latency buffers: every
    kernel those ops use runs once, and XLA's allocator grows to their outputs before the first real call
    (`Runtime.timings["warmup_execution"]`). warmup=False skips it (faster initialize; the first call pays it).
    Configs on the reference backend have nothing to warm. What is left for the first execution of the user's own
    program (loading its module, recording its CUDA graph) is XLA's: `jax_ep.warmup(compiled, *args)` runs that.

    Raises EPError naming the argument for a wrong mesh axis, a config whose num_experts is not divisible by the
    axis size, processes that disagree on the setup, or a warmup that is not a bool.
    """
    if not isinstance(warmup, bool):
        raise EPError(f"jax_ep.initialize: warmup must be a bool, got {type(warmup).__name__}")
    before = runtime.current()
    rt = runtime.initialize(mesh, *configs, **kwargs)
    if warmup and rt is not before:
        known = set(before.configs) if before is not None and before.mesh_shape == rt.mesh_shape else set()
        fresh = [c for c in dict.fromkeys(configs) if rt.backends.get(c) == "cuda" and c not in known]
        rt.timings.update(_warm_up_programs(mesh, fresh))
    return rt
