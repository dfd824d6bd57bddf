"""The public ops with backend="cuda" through jax_ep.initialize, against backend="reference" on the same GPUs.

Covers what the backend-level tests (test_cuda_backend.py) do not: runtime groups for a (dp=2, ep=2) mesh sharing
one handler attribute, gradients through the custom_vjp rules, trace-time initialization, and the compiled HLO
(no stray all-gather / all-to-all: the exchange is entirely jax_ep's custom calls).
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from cuda_backend_harness import assert_grads_close, require as _require

E, H, K, T = 32, 2048, 8, 64


def _mesh(dp, ep):
    devices = np.array(jax.devices("gpu")[: dp * ep])
    return Mesh(devices.reshape(dp, ep), ("dp", "ep")) if dp > 1 else Mesh(devices, ("ep",))


def _inputs(rng, groups, ranks):
    n = groups * ranks * T
    scores = np.abs(rng.normal(size=(n, E))) + 1
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    x = jnp.asarray(rng.normal(size=(n, H)), jnp.bfloat16)
    w = jnp.asarray(rng.random(size=idx.shape), jnp.float32)
    return x, jnp.asarray(idx), w


def _program(cfg, mesh):
    spec = P(tuple(mesh.axis_names))

    def body(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, cfg)
        y, yw = jax_ep.combine(out.recv_x, out.handle, cfg, out.recv_topk_weights)
        return out._replace(num_recv_tokens=out.num_recv_tokens[None]), y, yw

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))


@pytest.fixture(autouse=True)
def _finalize():
    yield
    jax_ep.finalize()


@pytest.mark.parametrize("dp,ep", [(1, 4), (2, 2), (1, 2)])
def test_public_ops_match_reference(dp, ep):
    _require(dp * ep)
    rng = np.random.default_rng(dp * 10 + ep)
    mesh = _mesh(dp, ep)
    cuda_cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    ref_cfg = jax_ep.EPConfig(E, H, K, T, backend="reference")
    rt = jax_ep.initialize(mesh, cuda_cfg, ref_cfg)
    assert rt.backends[cuda_cfg] == "cuda" and rt.transport == "cuda-peer"
    assert len(rt.groups["ep"]) == dp and rt.buffer_bytes > 0
    x, idx, w = _inputs(rng, dp, ep)
    got = _program(cuda_cfg, mesh)(x, idx, w)
    want = _program(ref_cfg, mesh)(x, idx, w)
    g_out, g_y, g_yw = got
    w_out, w_y, w_yw = want
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens", "num_recv_tokens_per_expert"):
        np.testing.assert_array_equal(np.asarray(getattr(g_out, name)), np.asarray(getattr(w_out, name)),
                                      err_msg=name)
    for name, a, b in zip(g_out.handle._fields, g_out.handle, w_out.handle):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"handle.{name}")
    np.testing.assert_allclose(np.asarray(g_y, np.float32), np.asarray(w_y, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(g_yw), np.asarray(w_yw), rtol=1e-5, atol=1e-6)


def test_gradients_match_reference():
    _require(4)
    rng = np.random.default_rng(5)
    mesh = _mesh(1, 4)
    cfgs = {b: jax_ep.EPConfig(E, H, K, T, backend=b) for b in ("cuda", "reference")}
    jax_ep.initialize(mesh, *cfgs.values())
    x, idx, w = _inputs(rng, 1, 4)
    scale = jnp.asarray(rng.normal(size=(4 * cfgs["cuda"].capacity(4), 1)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(4 * T, H)), jnp.float32)

    def grads(cfg):
        def loss(x, w):
            def body(x, idx, w, scale, cot):
                out = jax_ep.dispatch(x, idx, w, cfg)
                y, yw = jax_ep.combine((out.recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16), out.handle,
                                       cfg, out.recv_topk_weights * scale)
                return (jnp.sum(y.astype(jnp.float32) * cot) + jnp.sum(yw))[None]
            per_rank = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))(
                x, idx, w, scale, cot)
            return jnp.sum(per_rank)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    assert_grads_close(grads(cfgs["cuda"]), grads(cfgs["reference"]), ("d x", "d topk_weights"))


def test_compiled_hlo_has_no_stray_collectives():
    _require(4)
    mesh = _mesh(1, 4)
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    jax_ep.initialize(mesh, cfg)
    x, idx, w = _inputs(np.random.default_rng(0), 1, 4)
    hlo = _program(cfg, mesh).lower(x, idx, w).compile().as_text()
    for op in ("all-gather", "all-to-all", "all-reduce", "collective-permute"):
        assert op not in hlo, f"compiled program contains {op}"
    assert "jax_ep_dispatch_v4" in hlo and "jax_ep_combine_v4" in hlo


def test_trace_time_initialization_logs_once(caplog):
    """A config the runtime does not know is added at trace time on the runtime's mesh (logged once); with no
    runtime the op says to call initialize (it never guesses devices)."""
    _require(4)
    jax_ep.finalize()
    mesh = _mesh(1, 4)
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda", num_sms=16)
    x, idx, w = _inputs(np.random.default_rng(1), 1, 4)
    with pytest.raises(jax_ep.EPError, match="call jax_ep.initialize"):
        _program(cfg, mesh)(x, idx, w)
    jax_ep.initialize(mesh, jax_ep.EPConfig(E, H, K, T, backend="cuda", num_sms=8))
    with caplog.at_level(logging.WARNING, logger="jax_ep"):
        out = _program(cfg, mesh)(x, idx, w)
    assert any("adding it at trace time" in r.getMessage() for r in caplog.records)
    ref = jax_ep.EPConfig(E, H, K, T, backend="reference")
    np.testing.assert_array_equal(np.asarray(out[0].recv_x), np.asarray(_program(ref, mesh)(x, idx, w)[0].recv_x))
