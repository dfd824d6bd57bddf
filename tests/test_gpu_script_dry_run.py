"""scripts/gpu.sh without a GPU: DRY_RUN=1 prints every step's commands and runs none of them. Every step its --help
lists is one the script accepts (and prints), the steps it accepts are the ones --help lists, and a step it does not
know is refused with exit status 2."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu.sh"


def _gpu_sh(*args, dry=True):
    env = dict(os.environ, DRY_RUN="1") if dry else dict(os.environ)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _listed_steps():
    """The step names of --help: the first word of each line between 'steps:' and 'variables'."""
    text = _gpu_sh("--help", dry=False).stdout
    body = text.split("\nsteps:\n", 1)[1].split("\nvariables", 1)[0]
    return [m.group(1) for m in re.finditer(r"^  ([a-z][a-z-]*) ", body, flags=re.M)]


def _accepted_steps():
    """The step names of the script's dispatch `case` (the loop over its arguments), up to its catch-all `*)`."""
    text = SCRIPT.read_text()
    block = text.split('for s in "$@"; do\n  case $s in\n', 1)[1].split("\n    *)", 1)[0]
    return [name for m in re.finditer(r"^    ([a-z|-]+)\)", block, flags=re.M) for name in m.group(1).split("|")]


def test_help_lists_exactly_the_accepted_steps():
    listed, accepted = _listed_steps(), _accepted_steps()
    assert listed and sorted(listed) == sorted(set(listed)), listed
    assert sorted(listed) == sorted(accepted), (listed, accepted)


@pytest.mark.parametrize("step", _listed_steps())
def test_every_step_prints_its_commands(step):
    proc = _gpu_sh(step)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "# DRY_RUN" in proc.stdout
    # check expands to build suite multiprocess sanitize; every other step prints its own header
    headers = ["build", "suite", "multiprocess", "sanitize"] if step == "check" else [step]
    for h in headers:
        assert f"== {h}\n" in proc.stdout, proc.stdout[-2000:]


def test_unknown_step_is_refused():
    proc = _gpu_sh("no-such-step")
    assert proc.returncode == 2
    assert "unknown step 'no-such-step'" in proc.stderr


def test_chain_ab_reads_chain_args_as_shell_words():
    """CHAIN_ARGS keeps a quoted --only value (contender names have spaces) as one argument."""
    env = dict(os.environ, DRY_RUN="1", REPS="1",
               CHAIN_ARGS="--ll-tokens 1 --ll-mode per_expert,per_rank --only 'jax_ep LL dispatch fp8,jax_ep LL combine'")
    proc = subprocess.run(["bash", str(SCRIPT), "chain-ab"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "chain_gaps new 1" in line]
    assert len(lines) == 1, proc.stdout[-2000:]
    assert lines[0].endswith("jax_ep.bench.chain_gaps --ll-tokens 1 --ll-mode per_expert,per_rank --only "
                             "'jax_ep LL dispatch fp8,jax_ep LL combine'"), lines[0]


def test_chain_ab_times_every_tree_of_trees_in_order():
    """TREES="tag:dir ..." builds each tree as its own wheel (relative dirs from the repository root) and times them
    in that order every round."""
    env = dict(os.environ, DRY_RUN="1", REPS="2", TREES="base:ab_old v1:.gpu_tmp/v1 cur:.")
    proc = subprocess.run(["bash", str(SCRIPT), "chain-ab"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    wheels = [line.split("pip wheel ")[1].split(" ->")[0] for line in lines if "] pip wheel " in line]
    assert wheels == [f"{ROOT}/ab_old", f"{ROOT}/.gpu_tmp/v1", f"{ROOT}/."], wheels
    runs = [line.split("[chain_gaps ")[1].split(",")[0] for line in lines if "[chain_gaps " in line]
    assert runs == ["base 1", "v1 1", "cur 1", "base 2", "v1 2", "cur 2"], runs


def test_chain_ab_runs_chain_gaps_under_the_launcher_with_chain_processes():
    """CHAIN_PROCESSES=N times each tree in N processes (jax_ep.launch), with a symmetric heap for normal mode and
    XLA's preallocation on (receive pools, as the launcher leaves it)."""
    env = dict(os.environ, DRY_RUN="1", REPS="1", PYTHON="python3", CHAIN_PROCESSES="4",
               CHAIN_ARGS="--mode normal --tokens 4096")
    env.pop("NVSHMEM_SYMMETRIC_SIZE", None)
    env.pop("LAUNCH_PREALLOCATE", None)
    proc = subprocess.run(["bash", str(SCRIPT), "chain-ab"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "[chain_gaps " in line]
    assert len(lines) == 2, proc.stdout[-2000:]
    for line in lines:
        assert "NVSHMEM_SYMMETRIC_SIZE=12G XLA_PYTHON_CLIENT_PREALLOCATE=true python3 -m jax_ep.launch -n 4 -m " \
               "jax_ep.bench.chain_gaps --mode normal --tokens 4096" in line, line
