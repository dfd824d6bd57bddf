"""The contenders of one benchmark shape: jax_ep's ops and the JAX baselines, on the same routing."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from jax_ep.config import FP8_BLOCK

from . import baselines
from .harness import feed_row, to_global

AXIS = "ep"


@dataclasses.dataclass
class Case:
    name: str
    kind: str  # "jax_ep" or "baseline"
    op_kind: str  # "dispatch" or "combine": speedups compare within one op kind
    op: Callable
    args: tuple
    mesh: Mesh
    in_specs: tuple
    bytes_received: float  # mean over ranks of the row bytes a rank receives
    feedback: Callable = feed_row
    first_call: bool = False
    setting: Callable = contextlib.nullcontext  # a context the case is timed in


@contextlib.contextmanager
def staged():
    """Direct buffers off while the case is timed: dispatch receives through staging and the copy-out, combine sends
    its rows back into staging (the path of one process per GPU)."""
    from jax_ep import _native

    native = _native.module()
    was = native.direct_buffers_enabled()
    native.set_direct_buffers(False)
    try:
        yield
    finally:
        native.set_direct_buffers(was)


def deepep_routing(rng, ranks, tokens, experts, topk):
    """scores |N(0,1)| + 1 per expert, top-k without repeats (DeepEP's tests), for every rank: [R*T, K]."""
    scores = np.abs(rng.normal(size=(ranks * tokens, experts))) + 1
    return np.argsort(-scores, axis=1)[:, :topk].astype(np.int32)


def _random(shape, rng):
    """bf16 N(0,1) data made on the device (never time on zeros: they hide unwritten rows)."""
    key = jax.random.key(int(rng.integers(2**31)))
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16))(key)


def _received_rows(idx, ranks, tokens, experts):
    """Mean over ranks of rows received in normal mode (one per token per destination rank)."""
    dest = idx // (experts // ranks)
    in_rank = np.stack([np.any(dest == r, axis=1) for r in range(ranks)], axis=1)  # [R*T, R]
    return in_rank.sum() / ranks


def bench_mesh(devices) -> Mesh:
    return Mesh(np.array(devices), (AXIS,))


def bench_config(tokens, hidden, topk, experts, backend, num_sms, ll_mode="per_expert", nvl=8,
                 max_tokens=None) -> jax_ep.EPConfig:
    """The config of one sweep (the same object everywhere: __main__ initializes all of them up front). ll_mode
    "nvshmem": per_expert rows moved by NVSHMEM puts (allow_nvlink_for_low_latency=False). nvl: num_max_nvl_peers
    (below R, the LL ops run the NVSHMEM kernels with puts between the simulated nodes). max_tokens: T_max
    (max_tokens_per_rank) when the calls pass fewer tokens than the config holds; default `tokens`. A config given
    max_tokens always has low-latency buffers (above 256 tokens "None" would leave them out and time the reference
    backend)."""
    over_nvshmem = ll_mode == "nvshmem"
    return jax_ep.EPConfig(experts, hidden, topk, max_tokens or tokens, axis_name=AXIS,
                           low_latency_buffers=True if max_tokens else None, backend=backend, num_sms=num_sms,
                           low_latency_mode="per_expert" if over_nvshmem else ll_mode,
                           allow_nvlink_for_low_latency=not over_nvshmem, num_max_nvl_peers=nvl)


def _setup(devices, tokens, hidden, topk, experts, rng, backend, num_sms, ll_mode="per_expert", nvl=8,
           max_tokens=None):
    """Mesh, initialized config, DeepEP routing (numpy, for byte counts) and the sharded-to-be inputs."""
    mesh = bench_mesh(devices)
    cfg = bench_config(tokens, hidden, topk, experts, backend, num_sms, ll_mode, nvl, max_tokens)
    jax_ep.initialize(mesh, cfg)  # a no-op when __main__ initialized every config of the run already
    idx = deepep_routing(rng, len(devices), tokens, experts, topk)
    spec = P(AXIS)
    x = to_global(_random((len(devices) * tokens, hidden), rng), mesh, spec)
    w = to_global(rng.random(size=idx.shape).astype(np.float32), mesh, spec)
    return len(devices), mesh, cfg, idx, x, w


def normal_contenders(devices, tokens, hidden, topk, experts, rng, backend, num_sms, with_ragged, nvl=8):
    ranks, mesh, cfg, idx, x, w = _setup(devices, tokens, hidden, topk, experts, rng, backend, num_sms, nvl=nvl)
    rows = _received_rows(idx, ranks, tokens, experts)
    idx = to_global(idx, mesh, P(AXIS))
    q, scales = jax.jit(jax_ep.fp8.quantize_blocks)(x)
    bf16_bytes, fp8_bytes = rows * hidden * 2, rows * (hidden + hidden // FP8_BLOCK * 4)
    spec = P(AXIS)

    def ep_dispatch(x, idx, w):
        return jax_ep.dispatch(x, idx, w, cfg).recv_x

    def ep_dispatch_fp8(x, s, idx, w):
        return jax_ep.dispatch(x, idx, w, cfg, x_scales=s).recv_x

    def prepare(x, i, w):
        out = jax_ep.dispatch(x, i, w, cfg)
        return (out.recv_x,) + tuple(out.handle)

    recv_x, *handle = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(x, idx, w)

    def ep_combine(expert_out, *handle):
        return jax_ep.combine(expert_out, jax_ep.DispatchHandle(*handle), cfg)[0]

    cases = [
        Case("jax_ep dispatch bf16", "jax_ep", "dispatch", ep_dispatch, (x, idx, w), mesh, (spec,) * 3,
             bf16_bytes, first_call=True),
        Case("jax_ep dispatch fp8", "jax_ep", "dispatch fp8", ep_dispatch_fp8, (q, scales, idx, w), mesh,
             (spec,) * 4, fp8_bytes),
        Case("jax_ep combine bf16", "jax_ep", "combine", ep_combine, (recv_x, *handle), mesh,
             (spec,) * (1 + len(handle)), bf16_bytes, first_call=True),
    ]
    # the same ops without direct buffers, where they could differ: one process drives the group (one process per
    # GPU always stages)
    if jax.default_backend() == "gpu" and cfg.backend != "reference" and jax.process_count() == 1:
        cases += [
            Case("jax_ep dispatch bf16 staged", "jax_ep", "dispatch", ep_dispatch, (x, idx, w), mesh, (spec,) * 3,
                 bf16_bytes, setting=staged),
            Case("jax_ep dispatch fp8 staged", "jax_ep", "dispatch fp8", ep_dispatch_fp8, (q, scales, idx, w), mesh,
                 (spec,) * 4, fp8_bytes, setting=staged),
            Case("jax_ep combine bf16 staged", "jax_ep", "combine", ep_combine, (recv_x, *handle), mesh,
                 (spec,) * (1 + len(handle)), bf16_bytes, setting=staged),
        ]
    cases += _padded_cases([("dispatch", x, bf16_bytes), ("dispatch fp8", q, fp8_bytes)], idx, experts, mesh, rng,
                           bf16_bytes)
    if with_ragged:
        capacity = ranks * tokens

        def ragged(copies_fn, cap):
            def op(x, idx):
                rows_, dest = copies_fn(x, idx, experts, ranks)
                return baselines.ragged_dispatch(rows_, dest, cap, ranks, AXIS)[0]
            return op

        cases += [
            Case("ragged_all_to_all per rank dispatch", "baseline", "dispatch",
                 ragged(baselines.ragged_per_rank_rows, capacity), (x, idx), mesh, (spec,) * 2, bf16_bytes),
            Case("ragged_all_to_all per (token,expert) dispatch", "baseline", "dispatch",
                 ragged(baselines.ragged_per_expert_rows, capacity * topk), (x, idx), mesh, (spec,) * 2,
                 bf16_bytes),
            _ragged_combine_case(x, idx, experts, ranks, tokens, mesh, bf16_bytes),
        ]
    return cases


def _padded_cases(dispatches, idx, experts, mesh, rng, combine_bytes):
    """Padded all_to_all baselines: one dispatch per (op kind, payload, bytes charged) and the combine."""
    ranks = mesh.devices.size
    tokens, hidden = dispatches[0][1].shape[0] // ranks, dispatches[0][1].shape[1]
    spec = P(AXIS)

    def dispatch(x, idx):
        return baselines.padded_all_to_all_dispatch(x, idx, experts, ranks, AXIS)

    # first_call: XLA's own first execution of a plain program, the yardstick for jax_ep's (docs/BENCHMARKS.md)
    cases = [Case("all_to_all padded dispatch", "baseline", kind, dispatch, (payload, idx), mesh, (spec,) * 2, nbytes,
                  first_call=True)
             for kind, payload, nbytes in dispatches]
    cases.append(Case("all_to_all padded combine", "baseline", "combine",
                      lambda r: baselines.padded_all_to_all_combine(r, AXIS),
                      (_random((ranks * ranks, tokens, hidden), rng),), mesh, (spec,), combine_bytes, first_call=True))
    return cases


def _ragged_combine_case(x, idx, experts, ranks, tokens, mesh, nbytes):
    spec = P(AXIS)

    def prepare(x, idx):
        rows_, dest = baselines.ragged_per_rank_rows(x, idx, experts, ranks)
        recv, plan = baselines.ragged_dispatch(rows_, dest, ranks * tokens, ranks, AXIS)
        return (recv,) + plan

    prepared = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=(spec,) * 2, out_specs=spec))(x, idx)

    def op(recv, *plan):
        return baselines.ragged_combine(recv, plan, tokens, ranks, AXIS)

    return Case("ragged_all_to_all per rank combine", "baseline", "combine", op, tuple(prepared), mesh,
                (spec,) * len(prepared), nbytes)


def low_latency_contenders(devices, tokens, hidden, topk, experts, rng, backend, num_sms, with_ragged,
                           ll_mode="per_expert", nvl=8, max_tokens=None):
    """LL contenders of one mode (EPConfig.low_latency_mode; its name is appended unless per_expert), the padded
    all_to_all and, for per_expert, the overlap and ragged baselines. max_tokens: the configs' T_max (default
    `tokens`); the calls pass `tokens`."""
    ranks, mesh, cfg, idx, x, w = _setup(devices, tokens, hidden, topk, experts, rng, backend, num_sms, ll_mode,
                                         nvl, max_tokens)
    tag = "" if ll_mode == "per_expert" else f" ({ll_mode})"
    pairs = (idx >= 0).sum() / ranks  # rows received per rank: one per (token, expert)
    idx = to_global(idx, mesh, P(AXIS))
    spec = P(AXIS)

    def low_latency_dispatch(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True).recv_x

    def prepare(x, i):
        ll = jax_ep.low_latency_dispatch(x, i, cfg, use_fp8=False)
        return ll.recv_x, ll.handle

    recv_x, handle = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=(spec,) * 2, out_specs=spec))(x, idx)

    def low_latency_combine(expert_out, idx, w, handle):
        return jax_ep.low_latency_combine(expert_out, idx, w, handle, cfg)

    def ll_dispatch_bf16(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False).recv_x

    fp8_bytes, bf16_bytes = pairs * (hidden + hidden // FP8_BLOCK * 4), pairs * hidden * 2
    cases = [
        Case("jax_ep LL dispatch fp8" + tag, "jax_ep", "dispatch", low_latency_dispatch, (x, idx), mesh, (spec,) * 2,
             fp8_bytes, first_call=True),
        Case("jax_ep LL dispatch bf16" + tag, "jax_ep", "dispatch bf16", ll_dispatch_bf16, (x, idx), mesh,
             (spec,) * 2, bf16_bytes),
        Case("jax_ep LL combine bf16" + tag, "jax_ep", "combine", low_latency_combine, (recv_x, idx, w, handle),
             mesh, (spec,) * 4, bf16_bytes, first_call=True),
    ]
    if ll_mode != "per_expert":
        return cases
    cases += _padded_cases([("dispatch", x, fp8_bytes)], idx, experts, mesh, rng, bf16_bytes)
    if jax_ep.runtime.resolve_backend(cfg) == "cuda":
        cases += overlap_cases(cfg, mesh, x, idx, w, recv_x, handle, rng)
    if with_ragged:
        def ragged(x, idx):
            rows_, dest = baselines.ragged_per_expert_rows(x, idx, experts, ranks)
            return baselines.ragged_dispatch(rows_, dest, ranks * tokens * topk, ranks, AXIS)[0]
        cases.append(Case("ragged_all_to_all per (token,expert) dispatch", "baseline", "dispatch", ragged, (x, idx),
                          mesh, (spec,) * 2, fp8_bytes))
    return cases


def _after(value, *deps):
    """`value` with a data dependency on every array in deps (adds 0 * a float element of each; XLA does not fold
    float x 0, so the order survives optimization)."""
    for d in deps:
        zero = d.reshape(-1)[0].astype(jnp.float32) * 0.0
        value = value + zero.astype(value.dtype)
    return value


def overlap_cases(cfg, mesh, x, idx, w, recv_x, handle, rng, matmul_n=2048):
    """The split phases with independent work between them (SPEC §4): send -> matmul -> recv, against the same
    three back to back (send -> recv -> matmul) and the matmul alone. Data dependencies fix the order."""
    spec = P(AXIS)
    a = _random((mesh.devices.size * matmul_n, matmul_n), rng)

    def matmul(a):
        return jnp.dot(a, a, preferred_element_type=jnp.float32)

    def dispatch_overlapped(x, idx, a):
        pending, state = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=True,
                                                          state=jax_ep.low_latency_state(cfg))
        m = matmul(_after(a, state.value))  # the matmul runs after the send ...
        state = jax_ep.LowLatencyState(_after(state.value, m))  # ... and the receive after the matmul
        out, _ = jax_ep.low_latency_dispatch_recv(pending, cfg, state=state)
        return _after(m, out.recv_x_scales)

    def dispatch_back_to_back(x, idx, a):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        return matmul(_after(a, out.recv_x_scales))

    def combine_overlapped(expert_out, idx, w, handle, a):
        pending, state = jax_ep.low_latency_combine_send(expert_out, idx, w, handle, cfg,
                                                         state=jax_ep.low_latency_state(cfg))
        m = matmul(_after(a, state.value))
        state = jax_ep.LowLatencyState(_after(state.value, m))
        y, _ = jax_ep.low_latency_combine_recv(pending, cfg, state=state)
        return _after(m, y)

    def combine_back_to_back(expert_out, idx, w, handle, a):
        y = jax_ep.low_latency_combine(expert_out, idx, w, handle, cfg)
        return matmul(_after(a, y))

    def matmul_alone(a):
        return matmul(a)

    comb_args = (recv_x, idx, w, handle, a)
    return [
        Case("overlap: matmul alone", "overlap", "overlap", matmul_alone, (a,), mesh, (spec,), 0.0),
        Case("overlap: LL dispatch fp8 send|matmul|recv", "overlap", "overlap", dispatch_overlapped, (x, idx, a),
             mesh, (spec,) * 3, 0.0),
        Case("overlap: LL dispatch fp8 + matmul back to back", "overlap", "overlap", dispatch_back_to_back,
             (x, idx, a), mesh, (spec,) * 3, 0.0),
        Case("overlap: LL combine send|matmul|recv", "overlap", "overlap", combine_overlapped, comb_args, mesh,
             (spec,) * 5, 0.0),
        Case("overlap: LL combine + matmul back to back", "overlap", "overlap", combine_back_to_back, comb_args,
             mesh, (spec,) * 5, 0.0),
    ]


def low_latency_phase_programs(devices, tokens, hidden, topk, experts, rng, num_sms, ll_mode="per_expert", nvl=8,
                               max_tokens=None):
    """(fn, args) running LL dispatch fp8 then combine once, for per-kernel times from the profiler."""
    ranks, mesh, cfg, idx, x, w = _setup(devices, tokens, hidden, topk, experts, rng, "cuda", num_sms, ll_mode, nvl,
                                         max_tokens)
    spec = P(AXIS)

    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        expert_out = (out.recv_x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
        return jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    return fn, (x, to_global(idx, mesh, spec), w)
