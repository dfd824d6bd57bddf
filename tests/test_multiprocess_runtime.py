"""One process per GPU, the parts that run on CPU: team planning, the NVSHMEM environment, the setup fingerprint
and its agreement across real processes (python -m jax_ep.launch, reference backend), the clear error when the
NVSHMEM module is missing. The GPU side (NVSHMEM itself) is tests/gpu/test_multiprocess_cuda.py.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import jax
from jax.sharding import Mesh

import jax_ep
from jax_ep import config
from jax_ep.runtime import agreement, nvshmem, nvshmem_env, teams
from jax_ep.errors import EPError
from helpers import cpu_child_env  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MP = os.path.join(ROOT, "tests", "programs", "cpu")


# ---------------------------------------------------------------------------------------------------------
# team planning
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("R,nvl,subteams", [
    (4, 8, []),                                  # fits one NVLink domain: no sub team
    (4, 4, []),
    (4, 2, [(0, 2), (1, 3)]),                    # two "nodes" of two: sub teams by NVLink-local index
    (8, 2, [(0, 2, 4, 6), (1, 3, 5, 7)]),
    (8, 4, [(0, 4), (1, 5), (2, 6), (3, 7)]),
    (6, 4, [(0, 4), (1, 5), (2,), (3,)]),        # R not a multiple of nvl: the last "node" is partial
    (2, 1, [(0, 1)]),
])
def test_plan_teams_sizes_and_members(R, nvl, subteams):
    plan = teams.plan_teams({"ep": [tuple(range(R))]}, {"ep": {nvl}})
    assert plan[0].kind == "group" and plan[0].pes == tuple(range(R)) and plan[0].size == R
    assert (plan[0].start, plan[0].stride) == (0, 1)
    subs = [s for s in plan[1:] if s.kind == "nvl"]
    assert [s.ranks for s in subs] == subteams
    for j, s in enumerate(subs):
        assert s.kind == "nvl" and s.nvl_index == j and s.num_max_nvl_peers == nvl
        assert all(r % nvl == j for r in s.ranks)
        assert s.size == len(s.ranks) and s.stride == (nvl if s.size > 1 else 1)
    # every rank is in exactly one sub team when there are sub teams (none when the group fits one NVLink domain)
    assert sorted(r for s in subs for r in s.ranks) == (list(range(R)) if subteams else [])


@pytest.mark.parametrize("R,nvl,nodes", [
    (4, 8, []),                                  # fits one NVLink domain: the group is the node's team
    (4, 4, []),
    (2, 1, []),                                  # nodes of one rank: no team of one per node
    (4, 2, [(0, 1), (2, 3)]),
    (8, 4, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    (6, 4, [(0, 1, 2, 3), (4, 5)]),              # R not a multiple of nvl: the last node is partial
    (32, 8, [tuple(range(n, n + 8)) for n in range(0, 32, 8)]),
])
def test_plan_teams_nvlink_teams_are_the_nodes(R, nvl, nodes):
    """The NVLink team of a rank holds the ranks of its node (r // nvl), stride 1, after the group's RDMA teams."""
    plan = teams.plan_teams({"ep": [tuple(range(R))]}, {"ep": {nvl}})
    kinds = [s.kind for s in plan]
    assert kinds == sorted(kinds, key=["group", "nvl", "node"].index), kinds
    node_teams = [s for s in plan if s.kind == "node"]
    assert [s.ranks for s in node_teams] == nodes
    for n, s in enumerate(node_teams):
        assert s.node_index == n and s.num_max_nvl_peers == nvl and s.nvl_index is None
        assert all(r // nvl == n for r in s.ranks) and s.stride == 1 and s.size == len(s.ranks)
        assert f"node {n} (num_max_nvl_peers={nvl})" in s.describe()
    # every rank in exactly one node team, when there are node teams
    assert sorted(r for s in node_teams for r in s.ranks) == (list(range(R)) if nodes else [])


def test_plan_teams_dp_by_ep_and_strided_world_pes():
    # mesh (ep=2, dp=2) over processes [[0, 1], [2, 3]]: the EP groups are columns, PEs strided by 2
    groups = {"ep": [(0, 2), (1, 3)]}
    plan = teams.plan_teams(groups, {"ep": {8}})
    assert [(s.group_index, s.start, s.stride, s.size) for s in plan] == [(0, 0, 2, 2), (1, 1, 2, 2)]
    # nvl = 1 (one GPU per "node"): each group gets one sub team, all its ranks (local index 0), same PEs
    plan = teams.plan_teams(groups, {"ep": {1}})
    assert [(s.kind, s.pes) for s in plan] == [("group", (0, 2)), ("nvl", (0, 2)), ("group", (1, 3)), ("nvl", (1, 3))]
    assert teams.my_teams(plan, 2) == [(plan[0], 1), (plan[1], 1)]
    # (dp=2, ep=4) with nvl = 2 over 8 processes, EP groups along rows: sub teams strided by 2 in world PEs
    plan = teams.plan_teams({"ep": [(0, 1, 2, 3), (4, 5, 6, 7)]}, {"ep": {2}})
    assert [(s.kind, s.group_index, s.pes, s.stride) for s in plan] == [
        ("group", 0, (0, 1, 2, 3), 1), ("nvl", 0, (0, 2), 2), ("nvl", 0, (1, 3), 2), ("node", 0, (0, 1), 1),
        ("node", 0, (2, 3), 1),
        ("group", 1, (4, 5, 6, 7), 1), ("nvl", 1, (4, 6), 2), ("nvl", 1, (5, 7), 2), ("node", 1, (4, 5), 1),
        ("node", 1, (6, 7), 1)]
    # EP groups along columns of a (ep=4, dp=2) mesh: world PEs strided by 2, and so are the node teams' PEs
    plan = teams.plan_teams({"ep": [(0, 2, 4, 6), (1, 3, 5, 7)]}, {"ep": {2}})
    assert [(s.pes, s.stride) for s in plan if s.kind == "node"] == [((0, 2), 2), ((4, 6), 2), ((1, 3), 2),
                                                                     ((5, 7), 2)]


def test_plan_teams_order_is_deterministic():
    g = {"b": [(0, 1)], "a": [(0, 1)]}
    plan = teams.plan_teams(g, {"a": {2, 1}, "b": {2}})
    assert [(s.axis_name, s.kind, s.num_max_nvl_peers) for s in plan] == [
        ("a", "group", None), ("a", "nvl", 1), ("b", "group", None)]


@pytest.mark.parametrize("pes", [(1, 0), (0, 2, 3), (0, 0)])
def test_non_strided_group_is_an_error(pes):
    with pytest.raises(EPError, match=r"EP group 0 of axis 'ep' spans processes .* evenly strided"):
        teams.plan_teams({"ep": [pes]}, {})


def test_team_budget():
    plan = teams.plan_teams({"ep": [tuple(range(16))]}, {"ep": {8}})  # 1 + 8 RDMA teams + 2 NVLink teams
    teams.check_team_budget(plan, {})
    # EP32 (4 nodes of 8) fits NVSHMEM's default with every team at every node size
    for nvl in (1, 2, 4, 8, 16):
        teams.check_team_budget(teams.plan_teams({"ep": [tuple(range(32))]}, {"ep": {nvl}}), {})
    # the widest group the kernels take (kMaxGroupRanks = 256: EP256, 32 nodes of 8) fits NVSHMEM's default at every
    # node size of the NVSHMEM kernels: the group and its nvl RDMA teams, without the NVLink (node) teams when those
    # do not fit (EP256 in nodes of 8: 1 + 8 + 32 = 41 teams with them, 9 without)
    assert config.MAX_GROUP_RANKS == 256
    for nvl in (1, 2, 4, 8):
        full = teams.plan_teams({"ep": [tuple(range(256))]}, {"ep": {nvl}})
        made, note = teams.plan_within_budget({"ep": [tuple(range(256))]}, {"ep": {nvl}}, {})
        assert [s.kind for s in made] == ["group"] + ["nvl"] * nvl, (nvl, [s.kind for s in made])
        assert [s.size for s in made] == [256] + [256 // nvl] * nvl
        assert len(full) == 1 + nvl + (256 // nvl if nvl > 1 else 0)
        assert (note is None) == (nvl == 1), (nvl, note)
    with pytest.raises(EPError, match=r"need 11 NVSHMEM teams; with NVSHMEM_MAX_TEAMS=16 .* >= 19"):
        teams.check_team_budget(plan, {"NVSHMEM_MAX_TEAMS": "16"})
    with pytest.raises(EPError, match="NVSHMEM_MAX_TEAMS='x' is not an integer"):
        teams.check_team_budget(plan, {"NVSHMEM_MAX_TEAMS": "x"})


def test_nvlink_teams_are_dropped_with_a_note_when_only_they_exceed_the_budget():
    groups = {"ep": [tuple(range(32)), tuple(range(32, 64))]}  # dp=2 x EP32, nodes of 8
    plan, note = teams.plan_within_budget(groups, {"ep": {8}}, {})  # 2 x (1 + 8 + 4) = 26 + 8 > 32
    assert [s.kind for s in plan].count("node") == 0 and len(plan) == 18
    assert plan == [s for s in teams.plan_teams(groups, {"ep": {8}}) if s.kind != "node"]
    assert "made no NVLink (node) teams" in note and "NVSHMEM_MAX_TEAMS >= 34" in note
    plan, note = teams.plan_within_budget(groups, {"ep": {8}}, {"NVSHMEM_MAX_TEAMS": "34"})
    assert note is None and len(plan) == 26
    plan, note = teams.plan_within_budget({"ep": [tuple(range(16))]}, {"ep": {8}}, {})  # fits: every team
    assert note is None and [s.kind for s in plan].count("node") == 2
    # what does not fit without them either stays an error, counting the teams that are needed
    with pytest.raises(EPError, match=r"need 18 NVSHMEM teams; with NVSHMEM_MAX_TEAMS=20"):
        teams.plan_within_budget(groups, {"ep": {8}}, {"NVSHMEM_MAX_TEAMS": "20"})


def test_team_budget_counts_the_teams_earlier_initializes_made():
    """NVSHMEM never gives a team's slot back and runtime/nvshmem.py keeps every team it made for later initializes,
    so the budget of an initialize is the union of its plan and the teams already made (by key), not its plan alone:
    EP32 with nodes of 8, then nodes of 4, then 2 in one process adds RDMA and NVLink teams each time."""
    group = {"ep": [tuple(range(32))]}
    made = set()
    for nvl, want in ((8, 1 + 8 + 4), (4, 13 + 4 + 8), (2, 25 + 2 + 16)):
        plan = teams.plan_teams(group, {"ep": {nvl}})
        assert teams.teams_needed(plan, made) == want, (nvl, teams.teams_needed(plan, made))
        held = set(made)  # after the loop: the 25 teams the first two initializes made
        made |= {(s.start, s.stride, s.size) for s in plan}
    # the third initialize alone would fit (1 + 2 + 16 = 19 + 8 <= 32); with the 25 teams held it is 43
    third = teams.plan_teams(group, {"ep": {2}})
    teams.check_team_budget(third, {})
    assert len(held) == 25
    with pytest.raises(EPError, match=r"need \d+ NVSHMEM teams \(\d+ of them made by earlier initializes"):
        teams.check_team_budget(third, {}, existing=held)
    # without its NVLink teams the third fits beside the held ones only when they leave room: 25 + 2 = 27 + 8 > 32
    with pytest.raises(EPError, match="made by earlier initializes"):
        teams.plan_within_budget(group, {"ep": {2}}, {}, existing=held)
    # the same keys again cost nothing: an initialize that repeats an earlier plan reuses its teams
    first = teams.plan_teams(group, {"ep": {8}})
    assert teams.teams_needed(first, {(s.start, s.stride, s.size) for s in first}) == len(first)
    teams.check_team_budget(first, {}, existing={(s.start, s.stride, s.size) for s in first})


# ---------------------------------------------------------------------------------------------------------
# NVSHMEM environment (the one place that decides NVSHMEM_* variables)
# ---------------------------------------------------------------------------------------------------------
def test_parse_size():
    assert nvshmem_env.parse_size("1073741824") == 1 << 30
    assert nvshmem_env.parse_size("2G") == 2 << 30
    assert nvshmem_env.parse_size("512m") == 512 << 20
    assert nvshmem_env.parse_size("64KB") == 64 << 10
    with pytest.raises(EPError, match="cannot read NVSHMEM size '1.5G'"):
        nvshmem_env.parse_size("1.5G")


def test_nvshmem_environment_defaults():
    env = nvshmem_env.nvshmem_environment(10 << 20, {})
    assert env == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none",
                   "NVSHMEM_SYMMETRIC_SIZE": str(1 << 30)}
    big = nvshmem_env.nvshmem_environment(3 << 30, {})
    size = int(big["NVSHMEM_SYMMETRIC_SIZE"])
    assert size >= (3 << 30) + nvshmem_env.HEAP_HEADROOM_BYTES and size % nvshmem_env.HEAP_ROUND_BYTES == 0


def test_nvshmem_environment_respects_user_values_but_never_nvls():
    user = {"NVSHMEM_REMOTE_TRANSPORT": "ibgda", "NVSHMEM_SYMMETRIC_SIZE": "4G", "NVSHMEM_DISABLE_NVLS": "0"}
    env = nvshmem_env.nvshmem_environment(1 << 30, user)
    assert env == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "ibgda", "NVSHMEM_SYMMETRIC_SIZE": "4G"}


def test_nvshmem_environment_too_small_user_heap():
    with pytest.raises(EPError, match=r"NVSHMEM_SYMMETRIC_SIZE=1G \(1073741824 bytes\) is too small: these configs "
                                      r"need 2147483648 bytes"):
        nvshmem_env.nvshmem_environment(2 << 30, {"NVSHMEM_SYMMETRIC_SIZE": "1G"})


# ---------------------------------------------------------------------------------------------------------
# the NVSHMEM module is optional
# ---------------------------------------------------------------------------------------------------------
def test_missing_nvshmem_module_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(nvshmem, "_MODULE_NAME", "jax_ep._no_such_nvshmem_module")
    monkeypatch.setitem(nvshmem._process, "module", None)
    with pytest.raises(EPError, match=r"needs the NVSHMEM module jax_ep._jax_ep_nvshmem, which was not built .*"
                                      r"nvidia-nvshmem-cu13"):
        nvshmem.module()
    assert "was not built" in nvshmem.availability()
    info = nvshmem.prepare(1 << 20)
    assert info["module"] != "available" and "initialized" not in info


def test_import_jax_ep_does_not_load_nvshmem():
    code = ("import sys, jax_ep; import jax_ep.runtime, jax_ep.runtime.nvshmem; "
            "print('_jax_ep_nvshmem' in ' '.join(sys.modules), "
            "any('nvshmem_host' in l for l in open('/proc/self/maps')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout


# ---------------------------------------------------------------------------------------------------------
# fingerprint and its comparison
# ---------------------------------------------------------------------------------------------------------
def test_differences_name_fields_and_processes():
    a = {"configs": [{"hidden": 128, "num_topk": 2}], "mesh": {"axis_names": ["ep"]}}
    b = {"configs": [{"hidden": 256, "num_topk": 2}], "mesh": {"axis_names": ["ep"]}}
    c = {"configs": [{"hidden": 128, "num_topk": 2}, {"hidden": 64, "num_topk": 2}], "mesh": {"axis_names": ["ep"]}}
    assert agreement.differences({0: a, 1: a}) == []
    assert agreement.differences({0: a, 1: b, 2: a}) == ["configs[0].hidden: 128 on processes [0, 2], 256 on process [1]"]
    d = agreement.differences({0: a, 1: c})
    assert "configs.length: 1 on process [0], 2 on process [1]" in d
    assert "configs[1].hidden: '<missing>' on process [0], 64 on process [1]" in d


def test_fingerprint_of_a_cpu_mesh():
    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices.reshape(2, 2), ("dp", "ep"))
    c1 = jax_ep.EPConfig(8, 128, 2, 16, backend="reference")
    c2 = jax_ep.EPConfig(8, 256, 2, 16, backend="reference")
    fp = agreement.fingerprint(mesh, (c2, c1), {c1: "reference", c2: "reference"}, None)
    assert fp == agreement.fingerprint(mesh, (c1, c2), {c1: "reference", c2: "reference"}, None)
    assert fp["mesh"] == {"axis_names": ["dp", "ep"], "shape": [2, 2], "device_ids": [d.id for d in devices],
                          "device_processes": [0, 0, 0, 0]}
    assert [c["hidden"] for c in fp["configs"]] == [128, 256]
    groups = {"ep": jax_ep.runtime.lifecycle._groups_of(mesh, "ep")}
    assert agreement.group_pes(mesh, groups) == {"ep": [(0, 0), (0, 0)]}


# ---------------------------------------------------------------------------------------------------------
# agreement across real processes (CPU, reference backend)
# ---------------------------------------------------------------------------------------------------------
def _launch(case, timeout=120):
    p = subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "2", "--no-gpu-pinning", "--timeout", "90",
                        os.path.join(MP, "init_agreement.py"), "--case", case], cwd=ROOT, env=cpu_child_env(),
                       capture_output=True, text=True, timeout=timeout)
    lines = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\[rank (\d)\] RESULT \w+ process=\d (.*)$",
                                                              p.stdout, re.M)}
    return p, lines


def _seconds(line):
    return float(re.search(r"seconds=([\d.]+)$", line).group(1))


def test_same_setup_agrees_and_reinitializes():
    p, lines = _launch("same")
    assert p.returncode == 0 and sorted(lines) == [0, 1], p.stdout + p.stderr
    assert all(v.startswith("ok") for v in lines.values()), lines


@pytest.mark.parametrize("case,field", [
    ("hidden", "configs[0].hidden: 128 on process [0], 256 on process [1]"),
    ("mesh", "mesh.axis_names[0]: 'ep' on process [0], 'other' on process [1]"),
    ("put_bytes", "kernel_env.JAX_EP_LOW_LATENCY_PUT_BYTES: 8192 on process [0], 4096 on process [1]"),
    ("warmup_ops", "warmup_ops: True on process [0], False on process [1]"),
])
def test_mismatched_setup_is_an_error_naming_it(case, field):
    p, lines = _launch(case)
    assert p.returncode == 0 and sorted(lines) == [0, 1], p.stdout + p.stderr
    for r, line in lines.items():
        assert line.startswith("error=jax_ep.initialize: the 2 processes disagree on the setup"), line
        assert field in line, line
        assert _seconds(line) < 5, line


def test_absent_process_is_an_error_within_the_timeout():
    p, lines = _launch("absent")
    assert p.returncode == 0 and sorted(lines) == [0, 1], p.stdout + p.stderr
    assert "process [1] did not reach jax_ep.initialize" in lines[0], lines[0]
    assert 2.5 < _seconds(lines[0]) < 10, lines[0]
