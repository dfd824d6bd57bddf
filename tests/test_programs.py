"""Ops inside scan, AOT lower/compile, jax.export round trips, runtime lifecycle (SPEC §2, §5)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep
from helpers import ep_mesh, random_topk, sharded

R, E, H, K, T = 4, 8, 128, 2, 6
CFG = jax_ep.EPConfig(E, H, K, T, backend="reference")


def _routing(rng, steps):
    return jnp.asarray(np.stack([np.concatenate([random_topk(rng, T, E, K) for _ in range(R)])
                                 for _ in range(steps)]))


def _step(x, idx):
    """One EP round trip: every token comes back multiplied by the number of ranks that hold it."""
    out = jax_ep.dispatch(x, idx, jnp.ones(idx.shape, jnp.float32), CFG)
    y, _ = jax_ep.combine(out.recv_x, out.handle, CFG)
    return y


def test_scan_with_changing_routing():
    rng = np.random.default_rng(7)
    steps = 20
    idx = _routing(rng, steps)
    x = jnp.asarray(rng.integers(-4, 5, size=(R * T, H)), jnp.bfloat16)

    def body(x, idx_steps):
        def step(carry, idx):
            y = _step(x, idx)
            return carry + jax.lax.psum(jnp.sum(y.astype(jnp.float32)), "ep"), y
        total, ys = jax.lax.scan(step, jnp.zeros(()), idx_steps)
        return ys, jnp.broadcast_to(total, (1,))

    fn = jax.jit(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(P("ep"), P(None, "ep")),
                               out_specs=(P(None, "ep"), P("ep"))))
    ys, _ = fn(x, idx)
    for s in range(steps):
        ranks = np.zeros((R * T,), np.int64)
        for r in range(R):
            ranks += np.any(np.asarray(idx[s]) // (E // R) == r, axis=1)
        np.testing.assert_array_equal(np.asarray(ys[s], np.float32), np.asarray(x, np.float32) * ranks[:, None],
                                      err_msg=f"step {s}")


def test_lower_compile_and_export_round_trip():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(R * T, H)), jnp.bfloat16)
    idx = _routing(rng, 1)[0]
    mesh = ep_mesh(R)
    fn = sharded(_step, mesh, 2)
    x, idx = (jax.device_put(a, jax.sharding.NamedSharding(mesh, P("ep"))) for a in (x, idx))
    compiled = fn.lower(x, idx).compile()
    expected = np.asarray(compiled(x, idx), np.float32)
    np.testing.assert_array_equal(np.asarray(fn(x, idx), np.float32), expected)

    exported = jax.export.export(fn)(x, idx)
    blob = exported.serialize()
    restored = jax.export.deserialize(blob)
    np.testing.assert_array_equal(np.asarray(restored.call(x, idx), np.float32), expected)


def test_initialize_idempotent_and_finalize(caplog):
    mesh = ep_mesh(R)
    rt = jax_ep.initialize(mesh, CFG)
    assert rt.backends[CFG] == "reference" and rt.transport == "xla-collectives"
    assert [g.device_ids for g in rt.groups["ep"]] == [tuple(d.id for d in mesh.devices)]
    assert jax_ep.initialize(mesh, CFG) is rt
    ll_cfg = jax_ep.EPConfig(E, H, K, 2, backend="reference")
    rt2 = jax_ep.initialize(mesh, ll_cfg)  # adds a config, keeps the first
    assert set(rt2.configs) == {CFG, ll_cfg}
    jax_ep.finalize()
    jax_ep.finalize()  # twice is fine
    assert jax_ep.initialize(mesh, CFG).configs == (CFG,)
    jax_ep.finalize()


def test_groups_of_a_dp_by_ep_mesh():
    mesh = ep_mesh(2, dp=2)
    rt = jax_ep.initialize(mesh, jax_ep.EPConfig(E, H, K, T, backend="reference"))
    ids = np.asarray([[d.id for d in row] for row in mesh.devices])
    assert [g.device_ids for g in rt.groups["ep"]] == [tuple(ids[0]), tuple(ids[1])]
    jax_ep.finalize()


def test_initialize_errors():
    with pytest.raises(jax_ep.EPError, match=r"axis_name='experts' is not an axis of the mesh"):
        jax_ep.initialize(ep_mesh(R), jax_ep.EPConfig(E, H, K, T, axis_name="experts"))
    with pytest.raises(jax_ep.EPError, match="configs\\[0\\] must be an EPConfig"):
        jax_ep.initialize(ep_mesh(R), "cfg")
    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible"):
        jax_ep.initialize(ep_mesh(3), CFG)


def test_cuda_backend_on_cpu_is_an_error():
    if jax.devices()[0].platform != "cpu":
        pytest.skip("backend='cuda' is valid on this GPU machine; the error is for CPU-only programs")
    with pytest.raises(jax_ep.EPError, match="backend='cuda'"):
        jax_ep.initialize(ep_mesh(R), jax_ep.EPConfig(E, H, K, T, backend="cuda"))


def test_auto_backend_logs_choice(caplog):
    cfg = jax_ep.EPConfig(E, H, K, T, backend="auto", num_sms=20)
    from jax_ep.runtime import lifecycle

    lifecycle._state["logged"].clear()  # the choice is logged once per process and outcome
    with caplog.at_level(logging.WARNING, logger="jax_ep"):
        rt = jax_ep.initialize(ep_mesh(R), cfg)
    from jax_ep import _native
    expected = "cuda" if jax.devices()[0].platform == "gpu" and _native.available() else "reference"
    assert rt.backends[cfg] == expected
    assert any(f"uses the {expected} backend" in r.getMessage() for r in caplog.records)
    jax_ep.finalize()


def test_trace_time_runtime_extends_the_programs_runtime_or_says_to_initialize():
    """The trace-time fallback never guesses devices: a config unknown to the runtime is added at trace time when the
    runtime's mesh is the traced program's mesh; with no runtime (or another mesh) it is an EPError that says to
    call jax_ep.initialize."""
    from jax_ep.runtime import lifecycle

    jax_ep.finalize()
    cfg = jax_ep.EPConfig(E, H, K, T, backend="reference", num_sms=7)
    other = jax_ep.EPConfig(E, H, K, T, backend="reference", num_sms=9)
    mesh = ep_mesh(R)
    seen = {}

    def body(x):
        try:
            seen["runtime"] = lifecycle.runtime_for_trace(cfg, "dispatch")
        except jax_ep.EPError as e:
            seen["error"] = str(e)
        return x

    x = jnp.zeros((R * T, H), jnp.bfloat16)
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x)
    assert "runtime" not in seen and "call jax_ep.initialize(mesh, cfg)" in seen["error"]
    assert jax_ep.runtime.current() is None
    seen.clear()
    jax_ep.initialize(ep_mesh(2), other)  # a runtime on another mesh: still an error
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x)
    assert "is not the mesh of this program" in seen["error"]
    seen.clear()
    jax_ep.initialize(mesh, other)
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x)
    assert "error" not in seen, seen
    rt = jax_ep.runtime.current()
    assert set(rt.configs) == {cfg, other} and rt.mesh_shape == {"ep": R}
    jax_ep.finalize()


def test_warmup_runs_the_compiled_program_and_checks_its_arguments():
    mesh = ep_mesh(R)
    cfg = jax_ep.EPConfig(E, H, K, T, backend="reference")
    jax_ep.initialize(mesh, cfg)
    f = jax.jit(jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    x = jnp.ones((R * T, H), jnp.float32)
    compiled = f.lower(x).compile()
    out = jax_ep.warmup(compiled, x, calls=3)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
    for bad in (0, True, "2"):
        with pytest.raises(jax_ep.EPError, match="calls"):
            jax_ep.warmup(compiled, x, calls=bad)
    with pytest.raises(jax_ep.EPError, match="program"):
        jax_ep.warmup("not a function", x)
    jax_ep.finalize()
