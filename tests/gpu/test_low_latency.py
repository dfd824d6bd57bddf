"""Low-latency mode on the CUDA backend (public ops through jax_ep.initialize) against backend="reference", in both
modes of EPConfig.low_latency_mode ("per_expert", "per_rank"), on as many GPUs as the machine has (R = 1, 2, 4).

Oracle: the reference backend in the same mode on the same GPUs (itself checked against the NumPy oracle, and its
per_rank message tables against the oracle's, in the CPU suite: tests/test_reference_vs_oracle.py).
Dispatch: counts, layout_range, src_info and bf16 rows bit-identical; fp8 scales identical and fp8 codes within one
e4m3 step (XLA:GPU's f32 -> e4m3 conversion rounds some subnormals differently from the hardware cvt). Rows >=
recv_count are unspecified (SPEC §4) and not compared. Combine within f32-accumulation tolerance of bf16 outputs.
per_rank only: msg_token and token_rows bit-identical to the reference; the dispatch bit-identical to the CUDA
per_expert dispatch (same rows, same order); masked slots carry NaN weights, which must not reach y; the combine
within tolerance of the CUDA per_expert combine (the partial sums are summed in k order on both backends, but
XLA's einsum may order the f32 adds differently).

With JAX_EP_TEST_LOW_LATENCY_OVER_NVSHMEM=1 every config sets allow_nvlink_for_low_latency=False, so the per_expert
tests run the NVSHMEM put-with-signal kernels (nvshmem/device/low_latency.cu) and the per_rank ones skip (those
kernels are per_expert only); tests/gpu/test_low_latency_nvshmem.py runs this file that way under
`python -m jax_ep.launch` with JAX_EP_TRANSPORT=nvshmem.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from cuda_backend_harness import (assert_grads_close, ll_round_trip_grads, rel_error as _rel, require,
                                  step_routing, upto)

E, H, K, T_MAX = 32, 2048, 8, 128
MODES = ("per_expert", "per_rank")
OVER_NVSHMEM = os.environ.get("JAX_EP_TEST_LOW_LATENCY_OVER_NVSHMEM") == "1"


def _setup(mode, ranks=None, hidden=H):
    """(R, mesh, configs) over R = `ranks` GPUs (None: as many as the machine has, up to 4), initialized without
    warm-up programs (a runtime per test; suite time). configs: "cuda" and "reference" in `mode`, and for per_rank
    "cuda_per_expert", the CUDA per_expert config its outputs are also compared with. A short device timeout: a
    kernel bug ends the run in seconds instead of hanging it."""
    R = upto(4) if ranks is None else ranks
    require(R)
    if OVER_NVSHMEM and mode == "per_rank":
        pytest.skip("per_rank has no NVSHMEM kernels (allow_nvlink_for_low_latency=False needs per_expert)")
    mesh = Mesh(np.array(jax.devices("gpu")[:R]), ("ep",))

    def cfg(backend, m=mode):
        return jax_ep.EPConfig(E, hidden, K, T_MAX, backend=backend, timeout_seconds=10.0, low_latency_mode=m,
                               allow_nvlink_for_low_latency=not OVER_NVSHMEM)

    cfgs = {"cuda": cfg("cuda"), "reference": cfg("reference")}
    if mode == "per_rank":
        cfgs["cuda_per_expert"] = cfg("cuda", "per_expert")
    jax_ep.initialize(mesh, *cfgs.values(), warmup_ops=False)
    return R, mesh, cfgs


@pytest.fixture(autouse=True)
def _finalize():
    yield
    rt = jax_ep.runtime.current()
    if OVER_NVSHMEM and rt is not None:  # the NVSHMEM kernels really ran: their transport, their table installed
        from jax_ep import _native

        assert rt.transport == "nvshmem" and _native.module().has_low_latency_nvshmem_ops(), rt.summary()
    jax_ep.finalize()


def _inputs(rng, mode, ranks, tokens, hidden=H):
    """x [R*T, hidden] bf16, topk_idx [R*T, K] with -1, out-of-range and repeated ids, weights [R*T, K] f32 (per_rank:
    NaN in the -1 slots, whose weights are never used)."""
    x = jnp.asarray(rng.normal(size=(ranks * tokens, hidden)) * 3, jnp.bfloat16)
    w = rng.random(size=(ranks * tokens, K)).astype(np.float32)
    scores = np.abs(rng.normal(size=(ranks * tokens, E))) + 1
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.02] = E + 3  # out of range: treated as -1
    idx[:, -1] = np.where(rng.random(len(idx)) < 0.05, idx[:, 0], idx[:, -1])  # a repeated expert
    if mode == "per_rank":
        w[idx < 0] = np.nan
    return x, jnp.asarray(idx), jnp.asarray(w)


def _dispatch_program(cfg, mesh, use_fp8, split):
    """recv_x, scales, recv_count, src_info, layout_range, msg_token, token_rows (zeros where the mode has none)."""
    def body(x, idx):
        if split:
            out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=use_fp8),
                                                   cfg)
        else:
            out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=use_fp8)
        scales = out.recv_x_scales if use_fp8 else jnp.zeros((1,), jnp.float32)
        h = out.handle
        tables = (h.msg_token, h.token_rows) if h.msg_token is not None else (jnp.zeros((1,), jnp.int32),) * 2
        return (out.recv_x, scales, out.recv_count, h.src_info, h.layout_range) + tables

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep")))


def _fp8_codes_close(a, b):
    """Same sign and |code difference| <= 1 (e4m3 codes are monotonic in magnitude within a sign)."""
    ca, cb = np.asarray(a).view(np.uint8).astype(np.int32), np.asarray(b).view(np.uint8).astype(np.int32)
    same_sign = (ca & 0x80) == (cb & 0x80)
    close = np.abs((ca & 0x7F) - (cb & 0x7F)) <= 1
    both_zero = ((ca & 0x7F) == 0) & ((cb & 0x7F) == 0)
    return (same_sign & close) | both_zero


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("use_fp8", [True, False])
@pytest.mark.parametrize("tokens", [1, 64, 128])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_dispatch_matches_reference(ranks, tokens, use_fp8, split, mode):
    _check_dispatch(mode, ranks, tokens, use_fp8, H, split)


# Shapes the default ones miss: fp8 rows whose scales are not a multiple of 16 bytes (H % 512 != 0), one segment
# (H=128), the decode shape (H=7168), token counts that are not a multiple of a warp; one token (the fused one-kernel
# dispatch, with an odd count of fp8 scales at H=128 and H=384).
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("hidden,tokens", [(128, 37), (384, 5), (7168, 33), (128, 1), (384, 1), (7168, 1)])
@pytest.mark.parametrize("use_fp8", [True, False])
def test_dispatch_matches_reference_shapes(ranks, hidden, tokens, use_fp8):
    _check_dispatch("per_expert", ranks, tokens, use_fp8, hidden, False)


def _check_dispatch(mode, ranks, tokens, use_fp8, hidden, split):
    _, mesh, cfgs = _setup(mode, ranks, hidden)
    x, idx, _ = _inputs(np.random.default_rng(ranks * 1000 + tokens + hidden), mode, ranks, tokens, hidden)
    got = jax.device_get(_dispatch_program(cfgs["cuda"], mesh, use_fp8, split)(x, idx))
    want = jax.device_get(_dispatch_program(cfgs["reference"], mesh, use_fp8, False)(x, idx))
    fields = [("recv_count", 2), ("src_info", 3), ("layout_range", 4)]
    tables = [("msg_token", 5), ("token_rows", 6)] if mode == "per_rank" else []
    for name, i in fields + tables:
        np.testing.assert_array_equal(got[i], want[i], err_msg=name)
    num_local, rows = E // ranks, ranks * T_MAX
    valid = np.arange(rows)[None, :] < np.asarray(want[2]).reshape(ranks * num_local, 1)
    assert valid.sum() > 0

    def valid_rows(res):
        return np.asarray(res[0]).reshape(ranks * num_local, rows, hidden)[valid]

    g_x, w_x = valid_rows(got), valid_rows(want)
    if use_fp8:
        S = hidden // 128
        np.testing.assert_array_equal(got[1].reshape(-1, rows, S)[valid], want[1].reshape(-1, rows, S)[valid],
                                      err_msg="recv_x_scales")
        ok = _fp8_codes_close(g_x, w_x)
        assert ok.all(), f"{(~ok).sum()} fp8 values more than one e4m3 step from the reference"
        exact = np.mean(g_x.view(np.uint8) == w_x.view(np.uint8))
        print(f"fp8 codes identical to XLA's: {exact:.6f}")
    else:
        np.testing.assert_array_equal(g_x.view(np.uint16), w_x.view(np.uint16), err_msg="recv_x")
    if mode == "per_rank":  # the same rows in the same order as the CUDA per_expert dispatch
        per_expert = jax.device_get(_dispatch_program(cfgs["cuda_per_expert"], mesh, use_fp8, False)(x, idx))
        for name, i in fields:
            np.testing.assert_array_equal(got[i], per_expert[i], err_msg=f"{name} vs per_expert")
        view = np.uint8 if use_fp8 else np.uint16
        np.testing.assert_array_equal(g_x.view(view), valid_rows(per_expert).view(view), err_msg="vs per_expert")


def test_fp8_row_beyond_shared_memory_is_an_error_naming_hidden():
    """per_rank's dispatch send holds ~2.9 KB of static shared memory beside one quantized row (H + H/32 bytes) in
    the 48 KB a block gets without an opt-in: H=45568 fits the row alone (46992 bytes) but not both. The op fails
    with a message naming hidden and the shared memory, not a bare launch failure; per_expert (~1.7 KB of its own)
    still fits and matches the reference at that H, its fused op as two kernels (the one fused kernel holds ~3.8 KB
    beside the row). (The row size sits 700 bytes inside both bounds.)"""
    hidden = 45568
    _, mesh, cfgs = _setup("per_rank", 1, hidden)
    try:
        x, idx, _ = _inputs(np.random.default_rng(7), "per_rank", 1, 2, hidden)
        with pytest.raises(Exception, match=r"hidden=45568 needs 46992 bytes of shared memory"):
            jax.block_until_ready(_dispatch_program(cfgs["cuda"], mesh, True, False)(x, idx))
    finally:
        jax_ep.finalize()
    _check_dispatch("per_expert", 1, 2, True, hidden, False)


def _round_trip_program(cfg, mesh, split, combine_tokens=None):
    """dispatch (bf16) -> per-expert transform -> combine; returns y and the dispatch handle's src_info.
    combine_tokens: the combine takes the routing of only the first that many tokens of each rank."""
    def body(x, idx_all, w_all):
        idx, w = idx_all, w_all
        if combine_tokens is not None:
            idx, w = idx_all[:combine_tokens], w_all[:combine_tokens]
        if split:
            out = jax_ep.low_latency_dispatch_recv(jax_ep.low_latency_dispatch_send(x, idx_all, cfg, use_fp8=False),
                                                   cfg)
        else:
            out = jax_ep.low_latency_dispatch(x, idx_all, cfg, use_fp8=False)
        scale = (1.0 + 0.25 * jnp.arange(out.recv_x.shape[0], dtype=jnp.float32))[:, None, None]
        expert_out = (out.recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        if split:
            pending = jax_ep.low_latency_combine_send(expert_out, idx, w, out.handle, cfg)
            y = jax_ep.low_latency_combine_recv(pending, cfg)
        else:
            y = jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)
        return y, out.handle.src_info

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tokens", [1, 64, 128])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_combine_matches_reference(ranks, tokens, split, mode):
    _, mesh, cfgs = _setup(mode, ranks)
    x, idx, w = _inputs(np.random.default_rng(7 + ranks + tokens), mode, ranks, tokens)
    y_c, src_c = _round_trip_program(cfgs["cuda"], mesh, split)(x, idx, w)
    y_r, src_r = _round_trip_program(cfgs["reference"], mesh, False)(x, idx, w)
    np.testing.assert_array_equal(np.asarray(src_c), np.asarray(src_r))
    assert np.isfinite(np.asarray(y_c, np.float32)).all(), "NaN weights of masked slots leaked into y"
    assert _rel(y_c, y_r) <= 2 ** -7, f"combine relative error {_rel(y_c, y_r):.2e}"
    if mode == "per_rank":
        y_pe, _ = _round_trip_program(cfgs["cuda_per_expert"], mesh, False)(x, idx, w)
        assert _rel(y_c, y_pe) <= 2 ** -6, f"vs CUDA per_expert: {_rel(y_c, y_pe):.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [False, True])
def test_combine_of_fewer_tokens_than_its_dispatch(split, mode):
    """A combine may take the routing of only the first T' < T tokens of its dispatch (y is [T', H]): it matches the
    reference, and per_rank's send, which reads topk_weights [T', K] for the messages of this rank's own tokens,
    skips the messages of tokens >= T' instead of reading past it."""
    R, mesh, cfgs = _setup(mode)
    x, idx, w = _inputs(np.random.default_rng(13), mode, R, T_MAX)
    y_c, _ = _round_trip_program(cfgs["cuda"], mesh, split, combine_tokens=100)(x, idx, w)
    y_r, _ = _round_trip_program(cfgs["reference"], mesh, False, combine_tokens=100)(x, idx, w)
    assert y_c.shape == (R * 100, H)
    assert np.isfinite(np.asarray(y_c, np.float32)).all(), "NaN weights of masked slots leaked into y"
    assert _rel(y_c, y_r) <= 2 ** -7, f"combine relative error {_rel(y_c, y_r):.2e}"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tokens", [1, 128])
def test_auto_mode_runs_the_fixed_mode_of_the_calls_tokens(tokens, split):
    """The default "auto" resolves per call: with T_max=128 and K=8, a 1-token call runs per_expert and a 128-token
    call per_rank, bit-identical (src_info and y) to a config fixed to that mode, fused and split."""
    R = upto(4)
    require(R)
    if OVER_NVSHMEM:
        pytest.skip("the NVSHMEM kernels are per_expert only: auto has nothing to choose")
    mesh = Mesh(np.array(jax.devices("gpu")[:R]), ("ep",))
    auto = jax_ep.EPConfig(E, H, K, T_MAX, backend="cuda", timeout_seconds=10.0)
    mode = "per_rank" if tokens >= 128 else "per_expert"
    assert auto.low_latency_mode == "auto" and auto.low_latency_mode_for(R, tokens) == mode
    fixed = dataclasses.replace(auto, low_latency_mode=mode)
    jax_ep.initialize(mesh, auto, fixed, warmup_ops=False)
    x, idx, w = _inputs(np.random.default_rng(11 + tokens), "per_rank", R, tokens)
    y_a, src_a = _round_trip_program(auto, mesh, split)(x, idx, w)
    y_f, src_f = _round_trip_program(fixed, mesh, split)(x, idx, w)
    np.testing.assert_array_equal(np.asarray(src_a), np.asarray(src_f))
    np.testing.assert_array_equal(np.asarray(y_a).view(np.uint16), np.asarray(y_f).view(np.uint16))


def test_consecutive_calls_without_combine_between():
    """Two dispatches back to back (the second reuses the other half), then both combines: each op must see its
    own data."""
    R, mesh, cfgs = _setup("per_expert")
    rng = np.random.default_rng(3)
    x1, idx1, w1 = _inputs(rng, "per_expert", R, T_MAX)
    x2, idx2, w2 = _inputs(rng, "per_expert", R, T_MAX)

    def program(cfg):
        def body(x1, idx1, w1, x2, idx2, w2):
            a = jax_ep.low_latency_dispatch(x1, idx1, cfg, use_fp8=False)
            b = jax_ep.low_latency_dispatch(x2, idx2, cfg, use_fp8=False)
            ya = jax_ep.low_latency_combine(a.recv_x, idx1, w1, a.handle, cfg)
            yb = jax_ep.low_latency_combine(b.recv_x, idx2, w2, b.handle, cfg)
            return ya, yb
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep")))

    got = program(cfgs["cuda"])(x1, idx1, w1, x2, idx2, w2)
    want = program(cfgs["reference"])(x1, idx1, w1, x2, idx2, w2)
    for g, r in zip(got, want):
        assert _rel(g, r) <= 2 ** -7


def _scan_program(cfg, mesh, steps, tokens, use_fp8):
    """`steps` dispatch + combine steps in one lax.scan, new random routing (with -1 and out-of-range ids) every
    step; fp8: the combine gets the dequantized rows."""
    def body(x, key):
        me = lax.axis_index("ep")

        def step(carry, i):
            idx, w = step_routing(key, i, tokens, K, E)
            xi = x + (i % 5).astype(x.dtype)
            out = jax_ep.low_latency_dispatch(xi, idx, cfg, use_fp8=use_fp8)
            rows = out.recv_x
            if use_fp8:
                rows = (rows.astype(jnp.float32) * out.recv_x_scales.repeat(128, axis=2)).astype(jnp.bfloat16)
            y = jax_ep.low_latency_combine(rows, idx, w, out.handle, cfg)
            return carry + jnp.sum(out.recv_count), (y, out.recv_count)

        zero = jnp.zeros((), jnp.int32) + 0 * me
        total, (ys, counts) = lax.scan(step, zero, jnp.arange(steps))
        return total[None], ys[None], counts[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep")))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_fp8", [True, False])
@pytest.mark.parametrize("steps", [2, 100])
def test_scan_consecutive_calls_changing_routing(steps, use_fp8, mode):
    _check_scan(steps, 64, use_fp8, mode)


# One-token calls (the fused one-kernel dispatch): the same slots reused op after op, routing changing every step
@pytest.mark.parametrize("mode", MODES)
def test_scan_one_token_calls_changing_routing(mode):
    _check_scan(100, 1, True, mode)


def _check_scan(steps, tokens, use_fp8, mode):
    R, mesh, cfgs = _setup(mode)
    x = jnp.asarray(np.random.default_rng(11).normal(size=(R * tokens, H)), jnp.bfloat16)
    key = jax.random.key_data(jax.random.key(steps))[None]
    compiled = _scan_program(cfgs["cuda"], mesh, steps, tokens, use_fp8).lower(x, key).compile()
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""), "| command buffers in compiled HLO:",
          compiled.as_text().count("command_buffer"))
    t_c, y_c, n_c = jax.device_get(compiled(x, key))
    t_r, y_r, n_r = jax.device_get(_scan_program(cfgs["reference"], mesh, steps, tokens, use_fp8)(x, key))
    np.testing.assert_array_equal(n_c, n_r)
    np.testing.assert_array_equal(t_c, t_r)
    # fp8 codes may differ by one step from XLA's conversion: allow a few bf16 ulps of the largest value
    tol = 2 ** -5 if use_fp8 else 2 ** -7
    assert _rel(y_c, y_r) <= tol, f"relative error over {steps} steps {_rel(y_c, y_r):.2e}"


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_reference(mode):
    R, mesh, cfgs = _setup(mode)
    rng = np.random.default_rng(21)
    x, idx, w = _inputs(rng, mode, R, 64)
    w = jnp.where(jnp.isnan(w), 0.0, w)  # finite weights: the gradient reaches every slot
    cot = jnp.asarray(rng.normal(size=(R * 64, H)), jnp.float32)

    assert_grads_close(ll_round_trip_grads(cfgs["cuda"], mesh, x, idx, w, cot),
                       ll_round_trip_grads(cfgs["reference"], mesh, x, idx, w, cot), ("d x", "d topk_weights"))


def test_compiled_hlo_uses_the_split_custom_calls():
    R, mesh, cfgs = _setup("per_expert")
    x, idx, w = _inputs(np.random.default_rng(1), "per_expert", R, 16)
    text = _round_trip_program(cfgs["cuda"], mesh, True).lower(x, idx, w).compile().as_text()
    for target in ("jax_ep_low_latency_dispatch_send_v6", "jax_ep_low_latency_dispatch_recv_v6",
                   "jax_ep_low_latency_combine_send_v6", "jax_ep_low_latency_combine_recv_v6"):
        assert target in text, target
    for collective in ("all-to-all", "all-gather", "all-reduce"):
        assert collective not in text, f"stray {collective} in the compiled LL program"
