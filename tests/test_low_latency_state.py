"""Low-latency program order as data (jax_ep/low_latency_chain.py): the LowLatencyState threads through every LL op.

Two kinds of checks:
- results (reference backend, CPU): the state counts the LL ops of its chain, so a chain that broke anywhere (an op in
  a nested jit, scan, cond, remat or a gradient that did not get the previous state) ends with the wrong count; the
  state machine's errors (a third send in flight, sticky errors) are reported by check_low_latency_state;
- the lowered CUDA program (cross-platform lowering on CPU, no GPU needed): every jax_ep LL custom call aliases its
  state operand to its state result and takes the previous LL call's state result; the split phases are marked
  side-effecting (never dropped or moved), the fused ops are not (a program with an effect loses JAX's C++ dispatch
  fast path: hundreds of microseconds per call).
The GPU twins (real kernels, device-side checks) are in tests/gpu/test_low_latency.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import low_latency_chain as state_order
from helpers import ep_mesh, random_topk

R, E, H, K, T = 4, 8, 256, 2, 8
CFG = jax_ep.EPConfig(E, H, K, T, backend="reference")
SPEC = P("ep")


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    idx = jnp.asarray(np.concatenate([random_topk(rng, T, E, K) for _ in range(R)]))
    x = jnp.asarray(rng.normal(size=(R * T, H)), jnp.bfloat16)
    w = jnp.asarray(rng.random(size=idx.shape), jnp.float32)
    return x, idx, w


def _run(body, *args, out_specs=SPEC):
    f = jax.jit(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * len(args), out_specs=out_specs))
    return f(*args)


def _words(state_values):
    return np.asarray(state_values).reshape(-1, 4)


def _step(x, idx, w, st):
    """One decode step: dispatch + combine (2 LL ops)."""
    out, st = jax_ep.low_latency_dispatch(x, idx, CFG, use_fp8=False, state=st)
    y, st = jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, CFG, state=st)
    return y, st


# ---- the state machine itself -----------------------------------------------------------------------------------
def test_state_transitions_written_out():
    s0 = jax_ep.LowLatencyState(jnp.zeros(4, jnp.int32))
    s1 = state_order.after_send(s0)
    s2 = state_order.after_send(s1)
    s3 = state_order.after_send(s2)  # a third send with two in flight
    assert np.asarray(s1.value).tolist() == [1, 1, 0, 0]
    assert np.asarray(s2.value).tolist() == [2, 2, 0, 0]
    assert np.asarray(s3.value).tolist() == [2, 2, state_order.CHAIN_OVERSUBSCRIBED, 0]
    assert np.asarray(state_order.after_recv(s3).value).tolist() == [2, 1, 1, 0]  # the error is sticky
    assert np.asarray(state_order.after_recv(s2).value).tolist() == [2, 1, 0, 0]
    assert np.asarray(state_order.after_fused(s1).value).tolist() == [2, 1, 0, 0]
    assert np.asarray(state_order.after_fused(s2).value).tolist() == [2, 2, 1, 0]
    assert np.asarray(state_order.after_recv(s0).value).tolist() == [0, 0, 0, 0]  # never below zero


def test_check_names_the_ranks_and_the_problem():
    words = np.zeros((R, 4), np.int32)
    jax_ep.check_low_latency_state(jax_ep.LowLatencyState(jnp.asarray(words.reshape(-1))))
    words[2, 2] = state_order.DEVICE_OVERSUBSCRIBED
    with pytest.raises(jax_ep.EPError, match=r"rank\(s\) \[2\].*used one LowLatencyState twice"):
        jax_ep.check_low_latency_state(jnp.asarray(words.reshape(-1)))


# ---- chains under program transformations (reference backend) ---------------------------------------------------
def _final_state(body, *args):
    y, state = _run(body, *args)
    return np.asarray(y, np.float32), _words(state)


def test_flat_chain_counts_every_op():
    def body(x, idx, w):
        st = jax_ep.low_latency_state(CFG)
        y, st = _step(x, idx, w, st)
        y2, st = _step(y, idx, w, st)
        return y2, st.value

    y, words = _final_state(body, *_inputs())
    assert (words == [4, 0, 0, 0]).all()
    # the state does not change results: the same program without states
    def plain(x, idx, w):
        def step(x):
            out = jax_ep.low_latency_dispatch(x, idx, CFG, use_fp8=False)
            return jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, CFG)
        return step(step(x))

    np.testing.assert_array_equal(y, np.asarray(_run(plain, *_inputs()), np.float32))


@pytest.mark.parametrize("wrap", ["nested_jit", "scan", "fori_loop", "cond", "remat"])
def test_chain_survives_program_transformations(wrap):
    steps = 3

    def body(x, idx, w):
        st = jax_ep.low_latency_state(CFG)
        y, st = _step(x, idx, w, st)  # one step outside the transformation
        if wrap == "nested_jit":
            y, st = jax.jit(lambda a, s: _step(a, idx, w, s))(y, st)
            n = 2
        elif wrap == "scan":
            (y, st), _ = jax.lax.scan(lambda c, _: (_step(c[0], idx, w, c[1]), None), (y, st), None, length=steps)
            n = 1 + steps
        elif wrap == "fori_loop":
            y, st = jax.lax.fori_loop(0, steps, lambda i, c: _step(c[0], idx, w, c[1]), (y, st))
            n = 1 + steps
        elif wrap == "cond":
            y, st = jax.lax.cond(jnp.sum(idx) >= 0, lambda a, s: _step(a, idx, w, s), lambda a, s: _step(a, idx, w, s),
                                 y, st)
            n = 2
        else:
            y, st = jax.checkpoint(lambda a, s: _step(a, idx, w, s))(y, st)
            n = 2
        y, st = _step(y, idx, w, st)  # and one after it
        return y, st.value + jnp.zeros((4,), jnp.int32).at[3].set(n + 1)  # word 3 carries the expected step count

    _, words = _final_state(body, *_inputs(1))
    expected_steps = words[0, 3]
    assert (words[:, 0] == 2 * expected_steps).all(), words  # two LL ops per step, none lost
    assert (words[:, 1:3] == 0).all(), words


def test_chain_through_gradients():
    x, idx, w = _inputs(2)

    def loss(x, w):
        def body(x, idx, w):
            st = jax_ep.low_latency_state(CFG)
            y, st = _step(x, idx, w, st)
            return y, st.value

        y, st = jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC)(x, idx, w)
        return jnp.sum(y.astype(jnp.float32) ** 2), st

    (val, st), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    assert (_words(st) == [2, 0, 0, 0]).all()
    assert np.isfinite(np.asarray(dx, np.float32)).all() and np.abs(np.asarray(dx, np.float32)).sum() > 0
    assert np.isfinite(np.asarray(dw)).all()


# ---- split phases: the in-flight rule -------------------------------------------------------------------------------
def test_two_split_sends_in_flight_are_fine_a_third_is_an_error():
    x, idx, w = _inputs(3)

    def two(x, idx, w):
        st = jax_ep.low_latency_state(CFG)
        pa, st = jax_ep.low_latency_dispatch_send(x, idx, CFG, use_fp8=False, state=st)
        pb, st = jax_ep.low_latency_dispatch_send(x * 2, idx, CFG, use_fp8=False, state=st)
        a, st = jax_ep.low_latency_dispatch_recv(pa, CFG, state=st)
        b, st = jax_ep.low_latency_dispatch_recv(pb, CFG, state=st)
        return b.recv_x.astype(jnp.float32) - 2 * a.recv_x.astype(jnp.float32), st.value

    diff, st = _run(two, x, idx, w)
    assert (_words(st) == [2, 0, 0, 0]).all()
    assert np.abs(np.asarray(diff)).max() == 0
    jax_ep.check_low_latency_state(st)

    def three(x, idx, w):
        st = jax_ep.low_latency_state(CFG)
        pending = []
        for i in range(3):
            p, st = jax_ep.low_latency_dispatch_send(x, idx, CFG, use_fp8=False, state=st)
            pending.append(p)
        for p in pending:
            _, st = jax_ep.low_latency_dispatch_recv(p, CFG, state=st)
        return st.value

    st = _run(three, x, idx, w)
    assert (_words(st)[:, 2] == state_order.CHAIN_OVERSUBSCRIBED).all()
    with pytest.raises(jax_ep.EPError, match="two sends of this chain"):
        jax_ep.check_low_latency_state(st)


def test_without_a_state_ops_return_results_only():
    x, idx, w = _inputs(4)

    def body(x, idx, w):
        pending = jax_ep.low_latency_dispatch_send(x, idx, CFG, use_fp8=True)
        out = jax_ep.low_latency_dispatch_recv(pending, CFG)
        assert isinstance(pending, jax_ep.LowLatencyDispatchPending) and isinstance(out, jax_ep.LowLatencyDispatchOutput)
        return out.recv_count

    assert np.asarray(_run(body, x, idx, w)).sum() > 0


# ---- gradients that are not defined raise ---------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["fp8", "dispatch_send", "combine_send"])
def test_undefined_gradients_raise(which):
    x, idx, w = _inputs(5)

    def loss(x, w):
        def body(x, idx, w):
            if which == "fp8":
                out = jax_ep.low_latency_dispatch(x, idx, CFG, use_fp8=True)
                return out.recv_x_scales.sum(keepdims=True)[0]
            if which == "dispatch_send":
                out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx, CFG, use_fp8=False),
                                                       CFG)
                return out.recv_x.astype(jnp.float32).sum(keepdims=True)[0]
            out = jax_ep.low_latency_dispatch(x, idx, CFG, use_fp8=False)
            y = jax_ep.low_latency_combine_recv(
                jax_ep.low_latency_combine_send(out.recv_x, idx, w, out.handle, CFG), CFG)
            return y.astype(jnp.float32).sum(keepdims=True)[0]

        return jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC)(x, idx, w).sum()

    with pytest.raises(jax_ep.EPError, match="not differentiable"):
        jax.grad(loss, argnums=(0, 1))(x, w)


def test_masked_slots_ignore_their_weights_even_nan():
    x, idx, w = _inputs(6)
    idx = idx.at[:, 1].set(-1)
    w_nan = w.at[:, 1].set(jnp.nan)

    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, CFG, use_fp8=False)
        return jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, CFG)

    y = np.asarray(_run(body, x, idx, w_nan), np.float32)
    y_ref = np.asarray(_run(body, x, idx, w.at[:, 1].set(0.0)), np.float32)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y, y_ref)

    def loss(x, w):
        return jnp.sum(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC)(
            x, idx, w).astype(jnp.float32))

    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w_nan)
    assert np.isfinite(np.asarray(dx, np.float32)).all() and np.isfinite(np.asarray(dw)).all()
    assert (np.asarray(dw)[:, 1] == 0).all()


# ---- the lowered CUDA program (no GPU needed) ----------------------------------------------------------------------
@pytest.fixture
def cuda_lowering(monkeypatch):
    """Select the CUDA backend at trace time on this CPU machine (lowering only: nothing is compiled or run)."""
    from jax_ep import backends
    from jax_ep.ops import low_latency as ops_low_latency
    from jax_ep.backends import _ffi

    monkeypatch.setattr(_ffi._native, "ensure_registered", lambda: [])
    monkeypatch.setattr(ops_low_latency, "backend_for", lambda cfg, op, low_latency=False: backends.load_cuda())
    return jax_ep.EPConfig(E, H, K, T)


_CALL = re.compile(r"^\s*(%[\w#:]+) = stablehlo\.custom_call @(jax_ep_low_latency_\w+)\((.*?)\) \{(.*)$")


def _low_latency_calls(text):
    """[(result name, target, operand list, attribute text)] of the LL custom calls in one lowered module."""
    calls = []
    for line in text.splitlines():
        m = _CALL.match(line)
        if m:
            calls.append((m.group(1).split(":")[0], m.group(2), [o.strip() for o in m.group(3).split(",")],
                          m.group(4)))
    return calls


def _lower(body, *args):
    f = jax.jit(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * len(args), out_specs=SPEC))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_lowered_cuda_low_latency_calls_form_one_chain(cuda_lowering):
    cfg = cuda_lowering
    x, idx, w = _inputs(7)

    def body(x, idx, w):
        st = jax_ep.low_latency_state(cfg)
        a, st = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True, state=st)
        pb, st = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=st)
        b, st = jax_ep.low_latency_dispatch_recv(pb, cfg, state=st)
        pc, st = jax_ep.low_latency_combine_send(b.recv_x, idx, w, b.handle, cfg, state=st)
        y, st = jax_ep.low_latency_combine_recv(pc, cfg, state=st)
        y2, st = jax_ep.low_latency_combine(b.recv_x, idx, w, b.handle, cfg, state=st)
        return y + y2, st.value

    calls = _low_latency_calls(_lower(body, x, idx, w))
    assert [c[1] for c in calls] == ["jax_ep_low_latency_dispatch_v6", "jax_ep_low_latency_dispatch_send_v6",
                                     "jax_ep_low_latency_dispatch_recv_v6", "jax_ep_low_latency_combine_send_v6",
                                     "jax_ep_low_latency_combine_recv_v6", "jax_ep_low_latency_combine_v6"]
    for i, (name, target, operands, attrs) in enumerate(calls):
        split = "_send_" in target or "_recv_" in target
        assert ("has_side_effect = true" in attrs) == split, (target, attrs)
        assert f"operand_index = {len(operands) - 1}" in attrs, target  # the state is aliased in place
        assert re.search(r'axis = "ep"', attrs), attrs
        assert not re.search(r"group_id|ll_offset|low_latency_offset", attrs), attrs  # from the axis binding only
        if i:
            prev_name, prev_target = calls[i - 1][0], calls[i - 1][1]
            n_results = {"jax_ep_low_latency_dispatch_v6": 8, "jax_ep_low_latency_dispatch_recv_v6": 8}.get(prev_target, 2)
            assert operands[-1] == f"{prev_name}#{n_results - 1}", (target, operands, prev_name)


def test_lowered_cuda_scan_carries_the_state(cuda_lowering):
    cfg = cuda_lowering
    x, idx, w = _inputs(8)

    def body(x, idx, w):
        def step(carry, _):
            y, st = carry
            out, st = jax_ep.low_latency_dispatch(y, idx, cfg, use_fp8=False, state=st)
            y, st = jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, cfg, state=st)
            return (y, st), None

        (y, st), _ = jax.lax.scan(step, (x, jax_ep.low_latency_state(cfg)), None, length=4)
        return y, st.value

    text = _lower(body, x, idx, w)
    calls = _low_latency_calls(text)
    assert [c[1] for c in calls] == ["jax_ep_low_latency_dispatch_v6", "jax_ep_low_latency_combine_v6"]  # one body, looped
    dispatch, combine = calls
    assert combine[2][-1] == f"{dispatch[0]}#7"  # the state: the last of 8 results
    assert "stablehlo.while" in text


def test_no_private_jax_api_outside_the_kv_adapter():
    import pathlib

    root = pathlib.Path(jax_ep.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "jax._src" in p.read_text() and p.relative_to(root).as_posix() != "runtime/kv.py"]
    assert offenders == []


def test_fused_low_latency_program_keeps_the_cpp_dispatch_fast_path(cuda_lowering):
    """A decode step of fused LL ops has no JAX effects, so jit's C++ fast path dispatches it (an effect, e.g. a
    has_side_effect custom call, sends every call through Python: measured ~600 us per step on an H100)."""
    cfg = cuda_lowering
    x, idx, w = _inputs(9)

    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        return jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, cfg)

    f = jax.jit(jax.shard_map(body, mesh=ep_mesh(R), in_specs=(SPEC,) * 3, out_specs=SPEC))
    traced = f.trace(x, idx, w)
    assert not traced.jaxpr.effects, traced.jaxpr.effects
    assert "jax_ep_low_latency_dispatch_v6" in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_lowered_cuda_per_rank_mode_passes_the_message_tables(cuda_lowering):
    """per_rank mode on the CUDA backend: the attribute says so, the dispatch returns [R, T_max] / [R, T_max, K]
    tables and the combine takes exactly those (per_expert: empty [R, 0] tables)."""
    for mode, rows in (("per_rank", T), ("per_expert", 0)):
        cfg = jax_ep.EPConfig(E, H, K, T, low_latency_mode=mode)
        x, idx, w = _inputs(10)

        def body(x, idx, w, cfg=cfg):
            out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
            return jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, cfg)

        text = _lower(body, x, idx, w)
        calls = _low_latency_calls(text)
        assert [c[1] for c in calls] == ["jax_ep_low_latency_dispatch_v6", "jax_ep_low_latency_combine_v6"], calls
        (d_name, _, _, d_attrs), (_, _, c_ops, c_attrs) = calls
        for attrs in (d_attrs, c_attrs):
            assert f"per_rank = {int(mode == 'per_rank')} : i32" in attrs, attrs
        if mode == "per_rank":  # per_expert passes empty constants instead
            assert c_ops[3:5] == [f"{d_name}#5", f"{d_name}#6"], (mode, c_ops)
        result_types = re.search(r"stablehlo\.custom_call @jax_ep_low_latency_dispatch_v6.*-> \((.*)\)$", text, re.M).group(1)
        assert f"tensor<{R}x{rows}xi32>" in result_types and f"tensor<{R}x{rows}x{K}xi32>" in result_types, \
            result_types


@pytest.mark.parametrize("nvl,allow_nvlink,want_nvshmem,want_domain", [
    (8, True, 0, 8),    # R=4 fits one NVLink domain: the NVLink kernels
    (4, True, 0, 4),    # R = num_max_nvl_peers: still one domain
    (2, True, 1, 2),    # two nodes of two: NVSHMEM kernels, stores inside a node, puts between the nodes
    (1, True, 1, 1),    # four nodes of one
    (8, False, 1, 1),   # allow_nvlink_for_low_latency=False: NVSHMEM kernels, puts to every other rank
])
def test_lowered_low_latency_calls_choose_the_kernels_from_nvl_domains(cuda_lowering, nvl, allow_nvlink, want_nvshmem,
                                                              want_domain):
    """EPConfig.low_latency_over_nvshmem: a group wider than num_max_nvl_peers (or allow_nvlink_for_low_latency=False)
    lowers to the NVSHMEM kernels (nvshmem = 1) with the NVLink domain size they reach by stores (nvl_domain); every LL
    target of the program carries the same choice."""
    cfg = jax_ep.EPConfig(E, H, K, T, num_max_nvl_peers=nvl, allow_nvlink_for_low_latency=allow_nvlink)
    x, idx, w = _inputs(3)

    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        return jax_ep.low_latency_combine(out.recv_x, idx, w, out.handle, cfg)

    calls = _low_latency_calls(_lower(body, x, idx, w))
    assert [c[1] for c in calls] == ["jax_ep_low_latency_dispatch_v6", "jax_ep_low_latency_combine_v6"]
    for _, target, _, attrs in calls:
        assert re.search(rf"\bnvshmem = {want_nvshmem} : i32", attrs), (target, attrs)
        assert re.search(rf"\bnvl_domain = {want_domain} : i32", attrs), (target, attrs)
