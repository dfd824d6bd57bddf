"""Shared helpers of the GPU tests and the sanitizer program (tests/programs/sanitize/intranode_small.py) of the
CUDA backend in one process.

The CUDA backend is driven directly (jax_ep.backends.cuda inside shard_map) against jax_ep.backends.reference on the
same GPUs, after jax_ep.initialize made the groups and bound the mesh axis "ep" (the handlers find their buffers by
axis name), so these checks depend only on the Backend protocol of jax_ep/backends/base.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax_ep allocates its own staging with cudaMalloc
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import _native
from jax_ep.backends import reference
from jax_ep.config import EPConfig
from helpers import gpu_skip_reason  # tests/ is on sys.path

cuda_backend = jax_ep.backends.load_cuda() if _native.available() else None


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def skip_reason(num_gpus: int) -> str | None:
    """helpers.gpu_skip_reason with the GPUs JAX sees: the GPUs first, then the native extension."""
    return gpu_skip_reason(num_gpus, len(gpu_devices()))


def require(num_gpus: int) -> None:
    """pytest.skip (with the reason printed by -rs) unless num_gpus GPUs are here and the extension is built."""
    reason = skip_reason(num_gpus)
    if reason:
        import pytest

        pytest.skip(reason)


def upto(num_gpus: int) -> int:
    """min(num_gpus, GPUs here), at least 1 (pytest.skip without a GPU or the extension): tests that run on
    whatever the machine has."""
    n = max(1, min(num_gpus, len(gpu_devices())))
    require(n)
    return n


def rel_error(a, b) -> float:
    """max |a - b| relative to max(1, max |b|), in f64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))


def step_routing(key, step, tokens, num_topk, num_experts, weights=jax.random.uniform):
    """Inside shard_map over "ep": this rank's routing for step `step` of a scan, from a replicated key_data [1, 2]:
    ids in [-2, E + 2) (so -1s and out-of-range ids too) and weights drawn by `weights`, new at every step."""
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.fold_in(key[0], step), jax.lax.axis_index("ep")))
    idx = jax.random.randint(k1, (tokens, num_topk), -2, num_experts + 2, dtype=jnp.int32)
    return idx, weights(k2, (tokens, num_topk), jnp.float32)


def ll_round_trip_grads(cfg, mesh, x, idx, w, cot):
    """(d x, d topk_weights) of sum(cot * low_latency_combine(scale * low_latency_dispatch(x))) in shard_map over
    mesh axis "ep": bf16 dispatch, expert rows scaled per local expert (1, 1.5, 2, ...), weighted combine."""
    def loss(x, w):
        def body(x, idx, w, cot):
            out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
            scale = (1.0 + 0.5 * jnp.arange(out.recv_x.shape[0], dtype=jnp.float32))[:, None, None]
            expert_out = (out.recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
            y = jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)
            return jnp.sum(y.astype(jnp.float32) * cot)[None]
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep"))(x, idx, w, cot))
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


def assert_grads_close(got, want, names, rtol=1e-2):
    """Each gradient of `got` is finite and within rtol (relative L2 norm) of the same one of `want`."""
    for a, b, name in zip(got, want, names):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert np.isfinite(a).all() and rel < rtol, f"{name}: relative error {rel:.2e}"


class Group:
    """The runtime over the first R GPUs (mesh axis "ep"), initialized for `configs` (backend="cuda")."""

    def __init__(self, num_ranks: int, configs):
        self.devices = gpu_devices()[:num_ranks]
        self.mesh = jax.make_mesh((num_ranks,), ("ep",), devices=self.devices)
        self.configs = list(configs)
        self.activate()
        self.info = self.runtime.summary()

    def activate(self):
        """Makes this the current runtime (a no-op when it already is; another mesh finalizes the previous one)."""
        self.runtime = jax_ep.initialize(self.mesh, *self.configs)

    def close(self):
        jax_ep.finalize()

    def shard(self, a):
        return jax.device_put(jnp.asarray(a), NamedSharding(self.mesh, P("ep")))


def routing(rng, T, K, E, mode="deepep"):
    """[T, K] expert ids. deepep: scores |N(0,1)|+1, top-k without repeats. messy: plus -1s, ids >= E and < -1,
    repeats."""
    scores = np.abs(rng.standard_normal((T, E))) + 1
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    if mode == "messy":
        r = rng.random((T, K))
        idx[r < 0.15] = -1
        idx[(r >= 0.15) & (r < 0.2)] = E + 3
        idx[(r >= 0.2) & (r < 0.23)] = -5
        if K > 1:
            idx[: T // 3, K - 1] = idx[: T // 3, 0]
    if mode == "skewed":  # everyone sends to experts of rank 0: overflows a small capacity
        idx = rng.integers(0, max(1, E // 8), size=(T, K)).astype(np.int32)
    return idx


def inputs(rng, R, T, H, K, E, mode="deepep", fp8=False):
    idx = np.concatenate([routing(rng, T, K, E, mode) for _ in range(R)])
    w = rng.standard_normal((R * T, K)).astype(np.float32)
    if fp8:
        x = (rng.standard_normal((R * T, H)) * 50).astype(jnp.float8_e4m3fn)
        s = rng.random((R * T, H // 128)).astype(np.float32)
    else:
        x = rng.standard_normal((R * T, H)).astype(jnp.bfloat16)
        s = None
    return x, s, idx, w


def per_rank(tree):
    return jax.tree.map(lambda a: a[None], tree)


def both_backends(cfg: EPConfig, R: int, with_scales: bool):
    """shard_map body running dispatch, combine (bf16 + weights), cached_dispatch (f32 + weights) and combine
    (f32, no weights) on both backends."""

    def run(be, x, s, idx, w):
        out = be.dispatch(x, s, idx, w, cfg, R)
        y, yw = be.combine(_expert_values(out, with_scales), out.recv_topk_weights, out.handle, cfg, R)
        cp, cw = be.cached_dispatch(x.astype(jnp.float32) * 2, w, out.handle, cfg, R)
        y32, none = be.combine(cp, None, out.handle, cfg, R)
        assert none is None
        return dict(dispatch=out, y=y, y_weights=yw, cached=cp, cached_w=cw, y32=y32)

    def body(x, s, idx, w):
        return per_rank(dict(cuda=run(cuda_backend, x, s, idx, w), ref=run(reference, x, s, idx, w)))

    return body


def _expert_values(out, with_scales):
    if with_scales:  # fp8 rows -> bf16 "expert output"
        return out.recv_x.astype(jnp.bfloat16)
    return out.recv_x


def run_case(group: Group, cfg: EPConfig, R, x, s, idx, w):
    group.activate()
    body = both_backends(cfg, R, s is not None)
    if s is None:
        f = jax.jit(jax.shard_map(lambda x, i, w: body(x, None, i, w), mesh=group.mesh,
                                  in_specs=(P("ep"),) * 3, out_specs=P("ep")))
        res = f(group.shard(x), group.shard(idx), group.shard(w))
    else:
        f = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))
        res = f(group.shard(x), group.shard(s), group.shard(idx), group.shard(w))
    return jax.device_get(res)


def bits(a):
    a = np.asarray(a)
    if a.dtype.itemsize == 2 and a.dtype.kind not in "iu":
        return a.view(np.uint16)
    if a.dtype.itemsize == 1 and a.dtype.kind not in "iub":
        return a.view(np.uint8)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


def compare(res) -> list[str]:
    """Bit-identical where the spec says so; f32-accumulation tolerance for combine sums. Returns problems."""
    problems = []
    c, r = res["cuda"], res["ref"]
    exact = {"dispatch": (c["dispatch"], r["dispatch"]), "cached": (c["cached"], r["cached"]),
             "cached_w": (c["cached_w"], r["cached_w"])}
    for name, (a, b) in exact.items():
        la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
        if len(la) != len(lb):
            problems.append(f"{name}: different pytrees")
            continue
        for (path, xa), (_, xb) in zip(la, lb):
            key = name + jax.tree_util.keystr(path)
            if np.shape(xa) != np.shape(xb) or np.asarray(xa).dtype != np.asarray(xb).dtype:
                problems.append(f"{key}: shape/dtype {np.shape(xa)} {np.asarray(xa).dtype} vs {np.shape(xb)} "
                                f"{np.asarray(xb).dtype}")
            elif not np.array_equal(bits(xa), bits(xb)):
                bad = np.argwhere(bits(xa) != bits(xb))
                problems.append(f"{key}: {len(bad)} elements differ, first at {bad[:3].tolist()}")
    for name in ("y", "y_weights", "y32"):
        a = np.asarray(c[name]).astype(np.float32)
        b = np.asarray(r[name]).astype(np.float32)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {a.shape} vs {b.shape}")
            continue
        if np.isnan(a).any() or np.isnan(b).any():
            problems.append(f"{name}: NaN")
            continue
        denom = float((a * a + b * b).sum())
        diff = 0.0 if denom == 0 else 1 - 2 * float((a * b).sum()) / denom  # DeepEP calc_diff
        if diff > 1e-5 or not np.allclose(a, b, rtol=2e-2, atol=2e-2):
            problems.append(f"{name}: calc_diff {diff:.3e}, max abs diff {np.abs(a - b).max():.3e}")
    return problems
