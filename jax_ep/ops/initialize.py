"""`jax_ep.initialize`: the runtime's setup (runtime/lifecycle.py, `setup`), then one execution of every kernel family each
new config uses, before the user's first call.

For each new CUDA config, one jitted `shard_map` program over the runtime's mesh runs a normal-mode dispatch +
combine at the config's largest shapes (T = max_tokens_per_rank tokens per rank, routed to K distinct experts so
every transport leg moves rows: NVLink stores, NVSHMEM puts, forwarders), and, when the config has low-latency
buffers, a low-latency dispatch (fp8 when H allows it) + combine. Its inputs are made inside the program (iota),
so nothing crosses the host. Configs are warmed in the agreement's order (sorted by repr), never the call's.

What it warms: every kernel of those ops runs once (launch paths, NVSHMEM's first device-side
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

from .. import runtime
from ..config import EPConfig
from ..errors import EPError

log = logging.getLogger("jax_ep")


def _routing(cfg: EPConfig, num_ranks: int, rank, num_tokens=None):
    """[T, K] int32 (T = num_tokens, default max_tokens_per_rank), K distinct experts per token: with j = (t*K + k + rank) mod E (K consecutive values, distinct
    since K <= E), expert (j mod R) * L + (j div R) mod L, a bijection of [0, E) that puts consecutive j on
    consecutive ranks, so a token reaches min(K, R) ranks and every rank sends to every other even at T=1."""
    T, K, E = num_tokens or cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts
    L = E // num_ranks
    t = jax.lax.broadcasted_iota(jnp.int32, (T, K), 0)
    k = jax.lax.broadcasted_iota(jnp.int32, (T, K), 1)
    j = (t * K + k + rank) % E
    return (j % num_ranks) * L + (j // num_ranks) % L


# The parts of a config's warm-up: "normal" (dispatch + combine at T_max), "low_latency" (the fused LL dispatch +
# combine at T_max) and "low_latency_one_token" (the same at T=1, for an "auto" config whose 1-token calls run the
# other low-latency mode).
PART_TOKENS = {"normal": None, "low_latency": None, "low_latency_one_token": 1}


def _body(cfg: EPConfig, num_ranks: int, part: str):
    """The per-shard program of one part (PART_TOKENS): returns a [1] f32 that depends on every op's output (nothing
    is dead code)."""
    from . import low_latency, normal

    def body():
        rank = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
        T, H, K = PART_TOKENS[part] or cfg.max_tokens_per_rank, cfg.hidden, cfg.num_topk
        x = jnp.ones((T, H), jnp.bfloat16)
        idx = _routing(cfg, num_ranks, rank, T)
        w = jnp.full((T, K), 1.0 / K, jnp.float32)
        if part == "normal":
            out = normal.dispatch(x, idx, w, cfg)
            y, _ = normal.combine(out.recv_x, out.handle, cfg)
            acc = y[0, 0].astype(jnp.float32) + out.num_recv_tokens.astype(jnp.float32)
        else:
            ll = low_latency.low_latency_dispatch(x, idx, cfg, use_fp8=H % 128 == 0)
            expert_out = jnp.zeros(ll.recv_x.shape, jnp.bfloat16)
            y_ll = low_latency.low_latency_combine(expert_out, idx, w, ll.handle, cfg)
            acc = y_ll[0, 0].astype(jnp.float32) + ll.recv_count[0].astype(jnp.float32)
        return acc.reshape(1)

    return body


def _warm_up_program(mesh: jax.sharding.Mesh, cfg: EPConfig, part: str):
    """The compiled warm-up program of one part of cfg on mesh (no arguments; a [devices] f32 output, one entry per
    shard: normal, y[0, 0] + num_recv_tokens; low_latency, y[0, 0] + recv_count[0])."""
    body = _body(cfg, int(mesh.shape[cfg.axis_name]), part)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(tuple(mesh.axis_names)))).lower().compile()


def _parts(rt: runtime.Runtime, cfg: EPConfig) -> list[str]:
    """Which parts to warm: normal mode always, low latency when the config has its buffers; a part whose kernels
    need a load/store pointer to every rank (the NVLink kernels) is left out when this process's group has ranks
    NVSHMEM cannot map (other hosts): its handler refuses such a group when the program runs (initialize accepts
    it for the ops that do not need the pointers, docs/INTERNODE.md). Every rank of a group sees the same unmapped
    set, so the processes of a group agree."""
    R = len(rt.groups[cfg.axis_name][0].device_ids)
    unmapped = bool((getattr(rt.transport_state, "unmapped", None) or {}).get(cfg.axis_name))
    parts = ["normal"] if not unmapped or cfg.normal_over_nvshmem(R) else []
    if cfg.uses_low_latency_buffers() and (not unmapped or cfg.low_latency_over_nvshmem(R)):
        parts.append("low_latency")
        if cfg.low_latency_mode_for(R, 1) != cfg.low_latency_mode_for(R, cfg.max_tokens_per_rank):
            parts.append("low_latency_one_token")  # "auto": 1-token calls run the other mode's kernels
    return parts


def _warm_up_programs(mesh: jax.sharding.Mesh, configs, parts_of) -> dict[str, float]:
    """Runs the warm-up programs of every config (collective; `parts_of(cfg)` lists its parts) and returns
    {"warmup_ops": seconds} (empty when `configs` is empty). A part the ops refuse at trace time (an EPError or
    ValueError: a shape or mode they do not support; the same on every process) is skipped with a log line:
    initialize has nothing to warm for ops that cannot run. An error while a program runs (a kernel that traps, a
    missing peer) propagates."""
    if not configs:
        return {}
    t0 = time.perf_counter()
    for cfg in configs:
        for part in parts_of(cfg):
            try:
                compiled = _warm_up_program(mesh, cfg, part)
            except (EPError, ValueError, TypeError) as e:
                log.info("jax_ep.initialize: no %s warm-up program for %s: %s", part, cfg, e)
                continue
            jax.block_until_ready(compiled())
    return {"warmup_ops": time.perf_counter() - t0}


def _agree_on_warm_up(rt: runtime.Runtime, warmup_ops: bool, fresh) -> None:
    """With several processes: every process must run the same warm-up programs in the same order (they are
    collective), so the flag and the list are checked like the rest of initialize (EPError naming the difference)."""
    if jax.process_count() == 1:
        return
    from ..runtime import agreement

    agreement.agree(agreement.current_generation(), "warmup_ops",
                    {"warmup_ops": warmup_ops, "configs": [repr(c) for c in fresh]}, jax.process_index(),
                    jax.process_count(), agreement.timeout_of(rt.configs))


def initialize(mesh: jax.sharding.Mesh, *configs: EPConfig, warmup_ops: bool = True, **kwargs) -> runtime.Runtime:
    """Sets jax_ep up before the first traced call: eager, idempotent for the same (mesh, configs), collective
    with several processes.

    Sets up, for every config on the CUDA backend, the transport (buffers, peer access or NVSHMEM, teams), binds
    the mesh axes for the kernels and runs one warm-up exchange (runtime.setup). Then, with warmup_ops=True
    (the default), one execution per config new to the runtime of a program with a normal-mode dispatch + combine
    at the config's largest shapes, and of one with a low-latency dispatch + combine when the config has
    low-latency buffers (and one at T=1 when "auto" runs 1-token calls in the other mode): every kernel those ops use
    runs once, and XLA's allocator grows to their outputs before
    the first real call (`Runtime.timings["warmup_ops"]`). warmup_ops=False skips it (a faster initialize; the first
    call pays it); every process must pass the same value. Configs on the reference backend have nothing to warm.
    What is left for the first execution of the user's own program (loading its module, recording its CUDA graph)
    is XLA's: `jax_ep.warmup(compiled, *args)` runs that.

    Raises EPError naming the argument for a wrong mesh axis, an EP group of more than 256 ranks (MAX_GROUP_RANKS,
    kMaxGroupRanks; on every backend), a config whose num_experts is not divisible by the axis size, processes that
    disagree on the setup, or a warmup_ops that is not a bool.
    """
    if not isinstance(warmup_ops, bool):
        raise EPError(f"jax_ep.initialize: warmup_ops must be a bool, got {type(warmup_ops).__name__}")
    before = runtime.current()
    rt = runtime.setup(mesh, *configs, **kwargs)
    if rt is before:
        return rt  # nothing new (idempotent call)
    known = set(before.configs) if before is not None and before.mesh_shape == rt.mesh_shape else set()
    # in the agreement's order (sorted by repr), not the call's: processes may list the same configs differently
    fresh = sorted((c for c in set(configs) if rt.backends.get(c) == "cuda" and c not in known), key=repr)
    _agree_on_warm_up(rt, warmup_ops, fresh)
    if warmup_ops:
        rt.timings.update(_warm_up_programs(mesh, fresh, lambda c: _parts(rt, c)))
    return rt
