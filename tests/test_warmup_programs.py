"""jax_ep.initialize's warm-up execution (jax_ep/warmup_programs.py), on CPU with the reference backend: the program
really runs every op (its output matches a closed form of the routing it makes), the keyword is validated, and
initialize runs it for CUDA configs only (nothing to warm on the reference backend)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import jax_ep
from jax_ep import warmup_programs
from tests.helpers import ep_mesh


def _expected(cfg: jax_ep.EPConfig, num_ranks: int, low_latency: bool) -> np.ndarray:
    """Per rank of a group: what the warm-up program returns, from its routing formula alone (tokens all ones, so
    combine's y[0, 0] counts the distinct ranks of token 0; the LL combine gets zero expert outputs)."""
    T, K, E = cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts
    L = E // num_ranks
    t = np.arange(T)[:, None]
    k = np.arange(K)[None, :]
    experts = [(t * K + k + r) % E for r in range(num_ranks)]  # [T, K] per source rank
    out = []
    for r in range(num_ranks):
        y00 = len({int(e) // L for e in experts[r][0]})
        recv = sum(int(np.any(experts[s] // L == r, axis=1).sum()) for s in range(num_ranks))
        acc = float(y00 + recv)
        if low_latency:
            acc += float(sum(int((experts[s] == r * L).sum()) for s in range(num_ranks)))
        out.append(acc)
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("dp,ep,low_latency", [(1, 8, True), (2, 4, True), (1, 4, False)])
def test_warm_up_program_runs_every_op(dp, ep, low_latency):
    mesh = ep_mesh(ep, dp)
    cfg = jax_ep.EPConfig(num_experts=16, hidden=128, num_topk=4, max_tokens_per_rank=6, backend="reference",
                          low_latency_buffers=low_latency)
    got = np.asarray(warmup_programs._warm_up_program(mesh, cfg, cfg.uses_low_latency_buffers())())
    want = np.tile(_expected(cfg, ep, low_latency), dp)
    np.testing.assert_array_equal(got, want)


def test_warmup_keyword_is_checked():
    mesh = ep_mesh(2)
    cfg = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")
    with pytest.raises(jax_ep.EPError, match="warmup must be a bool"):
        jax_ep.initialize(mesh, cfg, warmup="yes")
    with pytest.raises(jax_ep.EPError, match="unexpected keyword"):
        jax_ep.initialize(mesh, cfg, warm_up=True)


def test_reference_configs_have_nothing_to_warm():
    mesh = ep_mesh(2)
    cfg = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")
    try:
        rt = jax_ep.initialize(mesh, cfg)
        assert "warmup_execution" not in rt.timings, rt.timings
    finally:
        jax_ep.finalize()


def test_only_configs_new_to_the_runtime_are_warmed(monkeypatch):
    """The CUDA configs of a call, minus those the runtime already had (pretend every config is CUDA: the list
    handed to the runner is what is checked, nothing runs)."""
    mesh = ep_mesh(2)
    a = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")
    b = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=8, backend="reference")
    seen = []
    monkeypatch.setattr(warmup_programs, "_warm_up_programs",
                        lambda m, cfgs: seen.append(list(cfgs)) or ({"warmup_execution": 0.0} if cfgs else {}))
    real = jax_ep.runtime.initialize

    def as_cuda(*args, **kw):
        rt = real(*args, **kw)
        rt.backends = {c: "cuda" for c in rt.backends}
        return rt

    monkeypatch.setattr(warmup_programs.runtime, "initialize", as_cuda)
    try:
        jax_ep.initialize(mesh, a)
        jax_ep.initialize(mesh, a)  # idempotent: the same runtime, nothing new
        jax_ep.initialize(mesh, a, b)
        jax_ep.initialize(mesh, b, warmup=False)  # a subset: the same runtime again
    finally:
        jax_ep.finalize()
    assert seen == [[a], [b]]


def test_a_refused_low_latency_part_falls_back_to_the_normal_ops(caplog, monkeypatch):
    """T above what the low-latency ops accept (an EPError at trace time): the normal-mode program still runs."""
    mesh = ep_mesh(4)
    cfg = jax_ep.EPConfig(num_experts=8, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference",
                          low_latency_buffers=True)
    calls = []
    real = warmup_programs._warm_up_program

    def refuse_low_latency(m, c, low_latency):
        calls.append(low_latency)
        if low_latency:
            raise jax_ep.EPError("jax_ep.low_latency_dispatch: refused for the test")
        return real(m, c, low_latency)

    caplog.set_level(logging.INFO, logger="jax_ep")
    monkeypatch.setattr(warmup_programs, "_warm_up_program", refuse_low_latency)
    timings = warmup_programs._warm_up_programs(mesh, [cfg])
    assert calls == [True, False]
    assert set(timings) == {"warmup_execution"}
    assert "refused for the test" in caplog.text
