"""jax_ep.initialize's warm-up execution (jax_ep/ops/initialize.py), on CPU with the reference backend: each
program really runs its ops (its output matches a closed form of the routing it makes), the routing reaches every
rank, the keyword is validated, only configs new to the runtime are warmed and in the agreement's order, and a
part the ops refuse at trace time is skipped."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import jax_ep
from jax_ep.ops import initialize as initialize_module
from helpers import ep_mesh


def _experts(cfg: jax_ep.EPConfig, num_ranks: int, rank: int, tokens=None) -> np.ndarray:
    """The routing of the warm-up program, rebuilt from its docstring's formula: [T, K] global expert ids (T =
    tokens, default T_max)."""
    T, K, E = tokens or cfg.max_tokens_per_rank, cfg.num_topk, cfg.num_experts
    L = E // num_ranks
    j = (np.arange(T)[:, None] * K + np.arange(K)[None, :] + rank) % E
    return (j % num_ranks) * L + (j // num_ranks) % L


def _expected(cfg: jax_ep.EPConfig, num_ranks: int, part: str) -> np.ndarray:
    """Per rank of a group, what the part's program returns. Tokens are all ones, so the normal combine's y[0, 0]
    counts the distinct ranks of token 0; the LL combine gets zero expert outputs, so only recv_count[0] is left."""
    L = cfg.num_experts // num_ranks
    experts = [_experts(cfg, num_ranks, r, initialize_module.PART_TOKENS[part]) for r in range(num_ranks)]
    out = []
    for r in range(num_ranks):
        if part == "normal":
            y00 = len({int(e) // L for e in experts[r][0]})
            recv = sum(int(np.any(experts[s] // L == r, axis=1).sum()) for s in range(num_ranks))
            out.append(float(y00 + recv))
        else:
            out.append(float(sum(int((experts[s] == r * L).sum()) for s in range(num_ranks))))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("dp,ep,part", [(1, 8, "normal"), (1, 8, "low_latency"), (2, 4, "normal"),
                                        (2, 4, "low_latency"), (1, 8, "low_latency_one_token")])
def test_warm_up_program_runs_its_ops(dp, ep, part):
    mesh = ep_mesh(ep, dp)
    cfg = jax_ep.EPConfig(num_experts=16, hidden=128, num_topk=4, max_tokens_per_rank=6, backend="reference")
    got = np.asarray(initialize_module._warm_up_program(mesh, cfg, part)())
    np.testing.assert_array_equal(got, np.tile(_expected(cfg, ep, part), dp))


@pytest.mark.parametrize("E,K,T,R", [(288, 8, 1, 8), (16, 4, 6, 8), (32, 1, 8, 4), (8, 8, 3, 2)])
def test_routing_has_distinct_experts_and_reaches_every_rank(E, K, T, R):
    """K distinct experts per token (what the ops require), and every rank sends to every other rank (so every
    transport leg moves rows), already at T=1 when K >= R - 1 (every case here has T * K >= R)."""
    cfg = jax_ep.EPConfig(num_experts=E, hidden=128, num_topk=K, max_tokens_per_rank=T, backend="reference")
    L = E // R
    for r in range(R):
        ids = _experts(cfg, R, r)
        assert ids.min() >= 0 and ids.max() < E
        assert all(len(set(row)) == K for row in ids.tolist())
        assert set((ids // L).ravel().tolist()) == set(range(R))


def test_warmup_ops_keyword_is_checked():
    mesh = ep_mesh(2)
    cfg = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")
    with pytest.raises(jax_ep.EPError, match="warmup_ops must be a bool"):
        jax_ep.initialize(mesh, cfg, warmup_ops="yes")
    with pytest.raises(jax_ep.EPError, match="unexpected keyword"):
        jax_ep.initialize(mesh, cfg, warmup=True)


def test_reference_configs_have_nothing_to_warm():
    mesh = ep_mesh(2)
    cfg = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")
    try:
        rt = jax_ep.initialize(mesh, cfg)
        assert "warmup_ops" not in rt.timings, rt.timings
    finally:
        jax_ep.finalize()


def test_only_configs_new_to_the_runtime_are_warmed_in_a_fixed_order(monkeypatch):
    """The CUDA configs of a call minus those the runtime already had, sorted by repr whatever the call's order
    (pretend every config is CUDA: the list handed to the runner is what is checked, nothing runs)."""
    mesh = ep_mesh(2)
    a, b, c = (jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=t, backend="reference")
               for t in (4, 8, 16))
    seen = []
    monkeypatch.setattr(initialize_module, "_warm_up_programs",
                        lambda m, cfgs, parts_of: seen.append(list(cfgs)) or ({"warmup_ops": 0.0} if cfgs else {}))
    real = jax_ep.runtime.setup

    def as_cuda(*args, **kw):
        rt = real(*args, **kw)
        rt.backends = {cfg: "cuda" for cfg in rt.backends}
        return rt

    monkeypatch.setattr(initialize_module.runtime, "setup", as_cuda)
    try:
        jax_ep.initialize(mesh, a)
        jax_ep.initialize(mesh, a)  # idempotent: the same runtime, nothing new
        jax_ep.initialize(mesh, c, a, b)
        jax_ep.initialize(mesh, b, warmup_ops=False)  # a subset: the same runtime again
    finally:
        jax_ep.finalize()
    assert seen == [[a], sorted([b, c], key=repr)]


def test_a_refused_part_is_skipped_and_the_others_run(caplog, monkeypatch):
    mesh = ep_mesh(4)
    cfg = jax_ep.EPConfig(num_experts=8, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")
    ran = []
    real = initialize_module._warm_up_program

    def refuse_low_latency(m, c, part):
        if part == "low_latency":
            raise jax_ep.EPError("jax_ep.low_latency_dispatch: refused for the test")
        compiled = real(m, c, part)
        return lambda: ran.append(part) or compiled()

    caplog.set_level(logging.INFO, logger="jax_ep")
    monkeypatch.setattr(initialize_module, "_warm_up_program", refuse_low_latency)
    timings = initialize_module._warm_up_programs(mesh, [cfg], lambda c: ["low_latency", "normal"])
    assert ran == ["normal"]
    assert set(timings) == {"warmup_ops"}
    assert "refused for the test" in caplog.text


class _Transport:
    def __init__(self, unmapped):
        self.unmapped = unmapped


@pytest.mark.parametrize("unmapped,nvl,allow_nvlink,ll_buffers,want", [
    ({}, 8, True, True, ["normal", "low_latency"]),
    ({}, 8, True, False, ["normal"]),
    ({"ep": [1]}, 8, True, True, []),                   # a group across hosts on the NVLink kernels: nothing runs
    ({"ep": [1]}, 8, False, True, ["low_latency"]),     # LL over NVSHMEM only (the normal ops need the pointers)
    ({"ep": [1]}, 1, True, True, ["normal", "low_latency"]),  # both modes over NVSHMEM
    ({"other": [1]}, 8, True, True, ["normal", "low_latency"]),
])
def test_parts_leave_out_kernels_that_need_pointers_to_unmapped_ranks(unmapped, nvl, allow_nvlink, ll_buffers,
                                                                       want):
    cfg = jax_ep.EPConfig(num_experts=4, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference",
                          num_max_nvl_peers=nvl, allow_nvlink_for_low_latency=allow_nvlink,
                          low_latency_buffers=ll_buffers)
    rt = jax_ep.Runtime(process_model="multi-process", transport="nvshmem", backends={cfg: "cuda"},
                        groups={"ep": [jax_ep.runtime.GroupInfo("ep", (0, 1))]}, buffer_bytes=0, timings={},
                        configs=(cfg,), mesh_shape={"ep": 2}, transport_state=_Transport(unmapped))
    assert initialize_module._parts(rt, cfg) == want


def test_auto_config_warms_the_one_token_mode_too():
    """An "auto" config whose T_max calls run per_rank (T_max >= 64, K=8 on 2 ranks) and whose 1-token calls run
    per_expert gets a third warm-up part at T=1; a fixed mode, or T_max below 64, does not."""
    def parts(**kw):
        cfg = jax_ep.EPConfig(num_experts=16, hidden=128, num_topk=8, backend="reference", low_latency_buffers=True,
                              **kw)
        rt = jax_ep.Runtime(process_model="single-process", transport="nvlink", backends={cfg: "cuda"},
                            groups={"ep": [jax_ep.runtime.GroupInfo("ep", (0, 1))]}, buffer_bytes=0, timings={},
                            configs=(cfg,), mesh_shape={"ep": 2}, transport_state=_Transport({}))
        return initialize_module._parts(rt, cfg)

    auto = jax_ep.EPConfig(16, 128, 8, 128)
    assert auto.low_latency_mode_for(2, 1) == "per_expert" and auto.low_latency_mode_for(2, 128) == "per_rank"
    assert parts(max_tokens_per_rank=128) == ["normal", "low_latency", "low_latency_one_token"]
    assert parts(max_tokens_per_rank=64) == ["normal", "low_latency", "low_latency_one_token"]
    assert parts(max_tokens_per_rank=63) == ["normal", "low_latency"]
    assert parts(max_tokens_per_rank=128, low_latency_mode="per_rank") == ["normal", "low_latency"]
