"""Team planning for the one-process-per-GPU model (pure Python, no NVSHMEM, no devices).

World PE p = jax process p (one GPU per process). Every EP group of a mesh axis becomes one NVSHMEM team made by
`nvshmem_team_split_strided` over the world, so its PEs must be evenly strided in rank order. When a group has more
ranks than `num_max_nvl_peers` (R > nvl), each rank also gets DeepEP's "RDMA team": the ranks of its group with the
same NVLink-local index, r' % nvl == r % nvl (stride nvl in rank order), and, when nodes have more than one rank
(nvl > 1), its "NVLink team": the ranks of its node, r' // nvl == r // nvl (stride 1 in rank order). On 4 GPUs with
nvl = 2 that makes two "nodes" {0, 1} and {2, 3} (the NVLink teams) and the RDMA teams {0, 2} and {1, 3}. The
kernels address peers by world PE and need neither sub team; they are there for node-local and same-index
collectives (docs/INTERNODE.md, "Teams and buffers").

`plan_teams` lists every split in one deterministic order; every process calls the splits in that order (each is
collective over the world, members or not).
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import EPError

# Teams NVSHMEM makes for itself at init (world, shared, node, same-mype-node, same-gpu, gpu-leaders, ...) count
# against NVSHMEM_MAX_TEAMS too; running out is fatal inside NVSHMEM, so plans keep this margin.
NVSHMEM_RESERVED_TEAMS = 8
NVSHMEM_DEFAULT_MAX_TEAMS = 32


@dataclasses.dataclass(frozen=True)
class TeamSpec:
    """One team split: world PEs start, start + stride, ..., in team rank order."""

    # "group" (one EP group), "nvl" (the RDMA team: ranks of a group with one NVLink-local index) or "node" (the
    # NVLink team: the ranks of one node of a group)
    kind: str
    axis_name: str
    group_index: int  # which EP group of the axis (row of the other mesh axes, in mesh order)
    nvl_index: int | None  # "nvl" teams: the NVLink-local index j (members: group ranks r with r % nvl == j)
    num_max_nvl_peers: int | None  # "nvl" and "node" teams: the nvl value it was made for
    pes: tuple[int, ...]  # world PEs in team rank order
    ranks: tuple[int, ...]  # the members' ranks in their EP group
    node_index: int | None = None  # "node" teams: the node n (members: group ranks r with r // nvl == n)

    @property
    def start(self) -> int:
        return self.pes[0]

    @property
    def stride(self) -> int:
        return self.pes[1] - self.pes[0] if len(self.pes) > 1 else 1

    @property
    def size(self) -> int:
        return len(self.pes)

    def describe(self) -> str:
        group = f"EP group {self.group_index} of axis {self.axis_name!r}"
        what = {"group": group,
                "nvl": f"NVLink-local index {self.nvl_index} (num_max_nvl_peers={self.num_max_nvl_peers}) of {group}",
                "node": f"node {self.node_index} (num_max_nvl_peers={self.num_max_nvl_peers}) of {group}"}[self.kind]
        return f"{what}: PEs {list(self.pes)} (start {self.start}, stride {self.stride}, size {self.size})"


def strided(pes, what: str) -> None:
    """Raises EPError unless `pes` are distinct, ascending and evenly spaced (a strided NVSHMEM team)."""
    pes = tuple(int(p) for p in pes)
    if not pes:
        raise EPError(f"jax_ep.initialize: {what} has no PEs")
    if len(pes) == 1:
        return
    stride = pes[1] - pes[0]
    if stride < 1 or any(b - a != stride for a, b in zip(pes, pes[1:])):
        raise EPError(
            f"jax_ep.initialize: {what} spans processes {list(pes)} in rank order; one process per GPU needs them "
            f"ascending and evenly strided (an NVSHMEM strided team), e.g. build the mesh from "
            f"jax.devices() sorted by process_index")


def nvl_members(num_ranks: int, num_max_nvl_peers: int) -> list[tuple[int, ...]]:
    """Rank lists of the NVLink-local-index sub teams of one group ([] when R <= nvl: no sub team)."""
    if num_ranks <= num_max_nvl_peers:
        return []
    return [tuple(range(j, num_ranks, num_max_nvl_peers)) for j in range(num_max_nvl_peers)]


def node_members(num_ranks: int, num_max_nvl_peers: int) -> list[tuple[int, ...]]:
    """Rank lists of the NVLink teams of one group, node by node ([] when R <= nvl: the group is one node and its
    own team; [] when nvl == 1: nodes of one rank). A last node of fewer ranks (R not a multiple of nvl) is partial."""
    if num_ranks <= num_max_nvl_peers or num_max_nvl_peers == 1:
        return []
    return [tuple(range(n, min(num_ranks, n + num_max_nvl_peers))) for n in range(0, num_ranks, num_max_nvl_peers)]


def plan_teams(groups: dict, nvl_values: dict) -> list[TeamSpec]:
    """Every team split of a runtime, in the order all processes make them.

    groups: axis name -> list of EP groups, each a tuple of world PEs in rank order.
    nvl_values: axis name -> iterable of num_max_nvl_peers values used by the CUDA configs of that axis.
    """
    plan: list[TeamSpec] = []
    for axis in sorted(groups):
        nvls = sorted({int(v) for v in nvl_values.get(axis, ())})
        for gi, pes in enumerate(groups[axis]):
            pes = tuple(int(p) for p in pes)
            strided(pes, f"EP group {gi} of axis {axis!r}")
            plan.append(TeamSpec("group", axis, gi, None, None, pes, tuple(range(len(pes)))))
            for nvl in nvls:
                for j, ranks in enumerate(nvl_members(len(pes), nvl)):
                    plan.append(TeamSpec("nvl", axis, gi, j, nvl, tuple(pes[r] for r in ranks), ranks))
                for n, ranks in enumerate(node_members(len(pes), nvl)):
                    plan.append(TeamSpec("node", axis, gi, None, nvl, tuple(pes[r] for r in ranks), ranks, n))
    return plan


def team_limit(environ=None) -> int:
    """NVSHMEM_MAX_TEAMS as NVSHMEM will read it (its default when unset); EPError when it is not an integer. Part of
    the transport plan every process compares (nvshmem.prepare): processes that differ would plan different teams."""
    environ = os.environ if environ is None else environ
    raw = environ.get("NVSHMEM_MAX_TEAMS", "")
    try:
        return int(raw) if raw else NVSHMEM_DEFAULT_MAX_TEAMS
    except ValueError:
        raise EPError(f"jax_ep.initialize: NVSHMEM_MAX_TEAMS={raw!r} is not an integer") from None


def teams_needed(plan, existing=()) -> int:
    """Team slots the process holds once `plan` is made: the plan's teams and the ones earlier initializes made
    (`existing`: their (start, stride, size) keys), counted once each. NVSHMEM does not give a destroyed team's
    slot back, so every team a process ever made keeps its slot (runtime/nvshmem.py keeps and reuses them)."""
    return len(set(existing) | {(s.start, s.stride, s.size) for s in plan})


def check_team_budget(plan, environ=None, existing=()) -> None:
    """Raises EPError when the plan, with the teams earlier initializes of this process made (`existing`), needs more
    teams than NVSHMEM_MAX_TEAMS allows (same answer on every process: the same plans in the same order)."""
    limit = team_limit(environ)
    needed = teams_needed(plan, existing)
    if needed + NVSHMEM_RESERVED_TEAMS > limit:
        earlier = needed - teams_needed(plan)
        held = (f" ({earlier} of them made by earlier initializes of this process, which NVSHMEM cannot free)"
                if earlier else "")
        raise EPError(f"jax_ep.initialize: the mesh and configs need {needed} NVSHMEM teams{held}; with "
                      f"NVSHMEM_MAX_TEAMS={limit} (about {NVSHMEM_RESERVED_TEAMS} taken by NVSHMEM itself) at most "
                      f"{limit - NVSHMEM_RESERVED_TEAMS} fit. Set NVSHMEM_MAX_TEAMS >= "
                      f"{needed + NVSHMEM_RESERVED_TEAMS} before the first jax_ep.initialize")


def plan_within_budget(groups: dict, nvl_values: dict, environ=None,
                       existing=()) -> tuple[list[TeamSpec], str | None]:
    """The teams to make: the whole plan when it fits NVSHMEM_MAX_TEAMS; else the plan without its NVLink ("node")
    teams, which no kernel uses, and a note saying so (several EP groups of a data-parallel axis multiply them:
    dp=2 x EP32 with nodes of 8 needs 34 teams with them, 26 without; so does a wide group: EP256, the widest
    (kMaxGroupRanks), in 32 nodes of 8 needs 41 with them, 9 without, which fits NVSHMEM's default of 32 with the
    reserved 8). `existing`: the (start, stride, size) keys of the teams earlier initializes of this process made,
    which keep their slots (teams_needed). EPError when even that does not fit. The same answer on every process
    (the same plan, history and environment)."""
    plan = plan_teams(groups, nvl_values)
    try:
        check_team_budget(plan, environ, existing)
        return plan, None
    except EPError:
        core = [s for s in plan if s.kind != "node"]
        if len(core) == len(plan):
            raise
    check_team_budget(core, environ, existing)
    needed = teams_needed(plan, existing)
    return core, (f"jax_ep.initialize: made no NVLink (node) teams: with them the mesh and configs need {needed} "
                  f"NVSHMEM teams, more than NVSHMEM_MAX_TEAMS allows (about {NVSHMEM_RESERVED_TEAMS} taken by "
                  f"NVSHMEM itself). No jax_ep kernel uses them; set NVSHMEM_MAX_TEAMS >= "
                  f"{needed + NVSHMEM_RESERVED_TEAMS} before the first jax_ep.initialize to have them")


def my_teams(plan, pe: int) -> list[tuple[TeamSpec, int]]:
    """(spec, this PE's rank in the team) for the teams `pe` is a member of."""
    return [(spec, spec.pes.index(pe)) for spec in plan if pe in spec.pes]
