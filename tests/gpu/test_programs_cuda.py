"""The design issue on the GPUs, for any number of GPUs R >= 1 (all visible GPUs form one EP group):

- low-latency program order as data: a 100-step decode loop in lax.scan threading one LowLatencyState (both buffer
  halves, many epochs) matches the reference backend; a third split send in flight and a forked state are reported
  by check_low_latency_state (chain and device checks), never a hang;
- location-free compiled programs: a program compiled and run (twice: the second run may be a CUDA-graph capture)
  before `initialize` adds one more config still runs correctly afterwards; a CUDA program exported with
  jax.export runs in a fresh process after deserialization (only the custom-call check disabled);
- the public ops (normal and low-latency) bit-identical to the reference backend on the same devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cuda_backend_harness as h  # tests/gpu is on sys.path

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep

SPEC = P("ep")
H, K, T = 512, 4, 32


def _setup(num_experts=None):
    h.require(1)
    R = len(h.gpu_devices())
    E = num_experts or 8 * R
    mesh = jax.sharding.Mesh(np.array(h.gpu_devices()), ("ep",))
    return R, E, mesh


def _inputs(R, E, seed):
    rng = np.random.default_rng(seed)
    idx = np.concatenate([h.routing(rng, T, K, E, "messy") for _ in range(R)])
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    w = rng.random(size=idx.shape).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(w)


def _run(mesh, body, *args, out_specs=SPEC):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * len(args), out_specs=out_specs))(*args)


def _decode_loop(cfg, steps):
    def body(x, idx, w):
        def step(carry, _):
            y, st = carry
            out, st = jax_ep.low_latency_dispatch(y, idx, cfg, use_fp8=False, state=st)
            rows = (out.recv_x.astype(jnp.float32) * 0.5).astype(jnp.bfloat16)
            y, st = jax_ep.low_latency_combine(rows, idx, w, out.handle, cfg, state=st)
            return (y, st), None

        (y, st), _ = jax.lax.scan(step, (x, jax_ep.low_latency_state(cfg)), None, length=steps)
        return y, st.value

    return body


def test_decode_loop_of_100_steps_in_scan_matches_the_reference():
    R, E, mesh = _setup()
    cuda = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    ref = jax_ep.EPConfig(E, H, K, T, backend="reference")
    jax_ep.initialize(mesh, cuda, ref)
    x, idx, w = _inputs(R, E, 0)
    y_c, st_c = _run(mesh, _decode_loop(cuda, 100), x, idx, w)
    y_r, st_r = _run(mesh, _decode_loop(ref, 100), x, idx, w)
    np.testing.assert_array_equal(np.asarray(st_c), np.asarray(st_r))
    assert (np.asarray(st_c).reshape(-1, 4) == [200, 0, 0, 0]).all()
    a, b = np.asarray(y_c, np.float32), np.asarray(y_r, np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())
    jax_ep.finalize()


def _three_sends(cfg, fork):
    """Three split sends in flight: on one chain (chain error), or two chains from one forked state (device error).
    `after` makes the receives wait for the third send, so the order on the stream is fixed."""

    def after(a, b):
        return a + (b.reshape(-1)[0] * 0).astype(a.dtype)

    def body(x, idx, w):
        st0 = jax_ep.low_latency_state(cfg)
        pa, st = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=st0)
        pb, st = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=st0 if fork else st)
        pc, st = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=st)
        st = jax_ep.LowLatencyState(after(st.value, pa.state.value))
        for p in (pa, pb, pc):
            _, st = jax_ep.low_latency_dispatch_recv(p, cfg, state=st)
        return st.value

    return body


@pytest.mark.parametrize("fork", [False, True])
def test_misordered_programs_are_errors_not_hangs(fork):
    R, E, mesh = _setup()
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    jax_ep.initialize(mesh, cfg)
    x, idx, w = _inputs(R, E, 1)
    st = _run(mesh, _three_sends(cfg, fork), x, idx, w)
    words = np.asarray(st).reshape(-1, 4)
    expected = 2 if fork else 1  # device check (forked state) / chain check (one chain)
    assert (words[:, 2] & expected).all(), words
    with pytest.raises(jax_ep.EPError, match="LowLatencyState twice" if fork else "two sends of this chain"):
        jax_ep.check_low_latency_state(st)
    # the device recovered: a correct program runs next
    y_c, st_c = _run(mesh, _decode_loop(cfg, 2), x, idx, w)
    assert (np.asarray(st_c).reshape(-1, 4) == [4, 0, 0, 0]).all()
    jax_ep.finalize()


def test_compiled_program_survives_initialize_with_one_more_config():
    R, E, mesh = _setup()
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    ref = jax_ep.EPConfig(E, H, K, T, backend="reference")
    jax_ep.initialize(mesh, cfg)
    x, idx, w = _inputs(R, E, 2)

    body = _round_trips(cfg)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)).lower(x, idx, w).compile()
    first = [np.asarray(a, np.float32) for a in f(x, idx, w)]
    f(x, idx, w)  # second execution: XLA may capture a CUDA graph here
    bigger = jax_ep.EPConfig(E, H, K, 4 * T, backend="cuda", low_latency_buffers=True)
    rt = jax_ep.initialize(mesh, cfg, bigger)
    assert rt.retired, "the earlier buffers are kept until finalize"
    for _ in range(3):
        again = [np.asarray(a, np.float32) for a in f(x, idx, w)]
        for a, b in zip(again, first):
            np.testing.assert_array_equal(a, b)
    expected = _run(mesh, _round_trips(ref), x, idx, w)
    for a, b in zip(first, expected):
        np.testing.assert_allclose(a, np.asarray(b, np.float32), rtol=2e-2, atol=2e-2 * np.abs(b).max())
    jax_ep.finalize()


def _round_trips(cfg):
    """Normal dispatch + combine and LL dispatch + combine of the same rows (one program)."""

    def body(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, cfg)
        y, _ = jax_ep.combine(out.recv_x, out.handle, cfg)
        ll = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        return y, jax_ep.low_latency_combine(ll.recv_x, idx, w, ll.handle, cfg)

    return body


_EXPORT_CHILD = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp
    import jax_ep
    from jax.sharding import NamedSharding, PartitionSpec as P
    R = len(jax.devices()); E = 8 * R
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    cfg = jax_ep.EPConfig(E, {H}, {K}, {T}, backend="cuda")
    jax_ep.initialize(mesh, cfg)   # the consumer sets up its own runtime; the artifact names only the axis
    exp = jax.export.deserialize(open(sys.argv[1], "rb").read())
    x, idx, w = (np.load(sys.argv[2])[k] for k in ("x", "idx", "w"))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
    y = exp.call(put(jnp.asarray(x, jnp.bfloat16)), put(jnp.asarray(idx)), put(jnp.asarray(w)))
    np.save(sys.argv[3], np.asarray(y, np.float32))
    print("EXPORT_CHILD_OK")
""")


def test_exported_cuda_program_runs_in_a_fresh_process(tmp_path):
    R, E, mesh = _setup()
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    jax_ep.initialize(mesh, cfg)
    x, idx, w = _inputs(R, E, 3)

    f = jax.jit(jax.shard_map(lambda *a: _round_trips(cfg)(*a)[0], mesh=mesh, in_specs=(SPEC,) * 3,
                              out_specs=SPEC))
    targets = ["jax_ep_dispatch_v4", "jax_ep_combine_v4", "jax_ep_low_latency_dispatch_v6", "jax_ep_low_latency_combine_v6",
               "jax_ep_layout_v1"]
    exp = jax.export.export(f, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in targets])(
        x, idx, w)
    (tmp_path / "prog.bin").write_bytes(exp.serialize())
    np.savez(tmp_path / "in.npz", x=np.asarray(x, np.float32), idx=np.asarray(idx), w=np.asarray(w))
    want = np.asarray(f(x, idx, w), np.float32)
    jax_ep.finalize()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _EXPORT_CHILD.format(H=H, K=K, T=T), str(tmp_path / "prog.bin"),
                          str(tmp_path / "in.npz"), str(tmp_path / "y.npy")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert "EXPORT_CHILD_OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), want)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_public_ops_bit_identical_to_reference(use_fp8):
    R, E, mesh = _setup()
    cuda = jax_ep.EPConfig(E, H, K, T, backend="cuda")
    ref = jax_ep.EPConfig(E, H, K, T, backend="reference")
    jax_ep.initialize(mesh, cuda, ref)
    x, idx, w = _inputs(R, E, 4)

    def body(cfg):
        def f(x, idx, w):
            out = jax_ep.dispatch(x, idx, w, cfg)
            ll = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=use_fp8)
            return (out.recv_x, out.recv_topk_idx, out.recv_topk_weights, out.handle.recv_src_idx, ll.recv_count,
                    ll.handle.src_info, ll.handle.layout_range, ll.recv_x_scales if use_fp8 else ll.recv_x)

        return f

    got = _run(mesh, body(cuda), x, idx, w)
    want = _run(mesh, body(ref), x, idx, w)
    counts = np.asarray(got[4]).reshape(R, -1)  # recv_count per (rank, local expert)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a), np.asarray(b)
        if i == 7:  # LL rows (bf16) or scales (fp8): only rows < recv_count are defined
            a, b = (v.reshape(R, counts.shape[1], -1, v.shape[-1]) for v in (a, b))
            for r in range(R):
                for l_ in range(counts.shape[1]):
                    np.testing.assert_array_equal(a[r, l_, :counts[r, l_]], b[r, l_, :counts[r, l_]])
            continue
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    jax_ep.finalize()
