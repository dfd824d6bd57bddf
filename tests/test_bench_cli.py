"""`python -m jax_ep.bench` runs end to end on CPU (tiny shapes) and writes what it promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


def test_bench_cli_small_cpu_run(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jax_ep.bench", "--tokens", "8", "--ll-tokens", "4", "--hidden", "128",
           "--experts", "8", "--ll-experts", "8", "--topk", "2", "--calls", "2", "--loops", "1",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "emulated CPU devices" in proc.stdout and "ragged baselines are skipped on CPU" in proc.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    names = {(r["mode"], r["name"], r["op"]) for r in data["results"]}
    for expected in [("normal", "jax_ep dispatch bf16", "dispatch"), ("normal", "jax_ep combine bf16", "combine"),
                     ("normal", "all_to_all padded dispatch", "dispatch"),
                     ("low_latency", "jax_ep LL dispatch fp8", "dispatch")]:
        assert expected in names, f"{expected} missing from {sorted(names)}"
    for r in data["results"]:
        assert "error" not in r, r
        assert r["us"] > 0 and r["gbps"] > 0 and r["ranks"] == 4, r
    assert data["meta"]["command"].startswith("python -m jax_ep.bench")
    assert "| mode | T | contender |" in proc.stdout


def test_bench_cli_rounds_interleave_contenders(tmp_path):
    # --repeat 2: every contender timed once per round, in turn; the time is the median of the rounds, ratios the
    # median of the per-round ratios with min-max
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jax_ep.bench", "--mode", "normal", "--tokens", "8", "--hidden", "128",
           "--experts", "8", "--topk", "2", "--calls", "2", "--loops", "1", "--repeat", "2",
           "--only", "jax_ep dispatch bf16,all_to_all padded", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rounds = [line.split("]", 1)[1].split(":")[0].strip() for line in proc.stdout.splitlines()
              if line.startswith("[normal T=8] round")]
    names = [r.split(" ", 2)[2] for r in rounds]
    per_round = len(names) // 2
    assert per_round >= 2 and names[:per_round] == names[per_round:], rounds  # the same order in both rounds
    assert [r.split(" ")[1] for r in rounds] == ["1/2"] * per_round + ["2/2"] * per_round, rounds
    data = json.loads((tmp_path / "results.json").read_text())
    for r in data["results"]:
        assert len(r["reps_us"]) == 2 and min(r["reps_us"]) <= r["us"] <= max(r["reps_us"]), r
        # one loop per round (--loops 1): each round's median is its one loop
        assert [round(v, 2) for v in r["reps_us"]] == r["loops_us"], r
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| normal | 8 | jax_ep dispatch bf16 |"))
    assert re.search(r"\| [0-9.]+x \([0-9.]+-[0-9.]+\) \|", row), row


def test_bench_cli_one_process_per_device_group(tmp_path):
    """The same benchmark under `python -m jax_ep.launch -n 2` (2 processes x 2 CPU devices): one table and one
    results.json, from process 0, covering all 4 devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the launcher sets the CPU devices per process (--cpu-devices)
    cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "2", "--no-gpu-pinning", "--cpu-devices", "2", "--timeout",
           "250", "-m", "jax_ep.bench", "--mode", "low_latency", "--ll-tokens", "4", "--hidden", "128",
           "--ll-experts", "8", "--topk", "2", "--calls", "2", "--loops", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "process model: multi-process (2 processes" in proc.stdout
    assert proc.stdout.count("| mode | T | contender |") == 1  # only process 0 prints the table
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["process_model"].startswith("multi-process")
    ours = [r for r in data["results"] if r["name"] == "jax_ep LL dispatch fp8"]
    assert ours and all(r["ranks"] == 4 and r["us"] > 0 and "error" not in r for r in ours), ours


def test_reliability_cli_small_cpu_run():
    """python -m jax_ep.bench.reliability on CPU: the long run compares the reference backend with itself at every
    step (a wiring check of the per-step records and the final LL state) and the lifecycle part says it needs a GPU."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jax_ep.bench.reliability", "--steps", "6", "--cycles", "1", "--tokens", "8",
           "--hidden", "128", "--topk", "2", "--experts-per-rank", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "4 x cpu" in proc.stdout
    assert "final LL state [12, 0, 0, 0]" in proc.stdout and ": OK" in proc.stdout
    assert "lifecycle: skipped (no CUDA backend here" in proc.stdout


def test_bench_cli_calls_below_the_configs_token_budget(tmp_path):
    """--ll-max-tokens: the low-latency configs hold T_max tokens, the calls pass fewer (a decoder sized for its
    largest batch); below --ll-tokens it is a usage error naming the option."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    base = [sys.executable, "-m", "jax_ep.bench", "--mode", "low_latency", "--ll-tokens", "1,3", "--hidden", "128",
            "--ll-experts", "8", "--topk", "2", "--calls", "2", "--loops", "1", "--ll-mode", "per_expert,per_rank",
            "--only", "jax_ep LL dispatch fp8", "--out", str(tmp_path)]
    proc = subprocess.run(base + ["--ll-max-tokens", "8"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert sorted((r["tokens"], r["name"]) for r in rows) == [
        (1, "jax_ep LL dispatch fp8"), (1, "jax_ep LL dispatch fp8 (per_rank)"),
        (3, "jax_ep LL dispatch fp8"), (3, "jax_ep LL dispatch fp8 (per_rank)")], rows
    assert all(r["max_tokens"] == 8 and r["us"] > 0 for r in rows), rows
    bad = subprocess.run(base + ["--ll-max-tokens", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--ll-max-tokens 2 is below --ll-tokens 3" in bad.stderr, bad.stderr[-1000:]


def test_bench_cli_marginal_time_per_added_call(tmp_path):
    """--marginal: each loop is followed by one of 2N calls; every row gets marginal_us (median over rounds of the
    median (t(2N) - t(N)) / N) with one value per round, and the table two more columns."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jax_ep.bench", "--mode", "normal", "--tokens", "8", "--hidden", "128",
           "--experts", "8", "--topk", "2", "--calls", "2", "--loops", "3", "--repeat", "2", "--marginal",
           "--only", "jax_ep dispatch bf16,all_to_all padded", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| per added call (us) | x best JAX baseline per added call |" in proc.stdout
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert rows and all(len(r["marginal_reps_us"]) == 2 and r["marginal_us"] is not None for r in rows), rows
    assert all(min(r["marginal_reps_us"]) <= r["marginal_us"] <= max(r["marginal_reps_us"]) for r in rows), rows
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| normal | 8 | jax_ep dispatch bf16 |"))
    # a ratio with its per-round range; on emulated CPU devices the difference of two loop times can be negative
    num = r"-?[0-9.]+"
    assert row.count("|") == 11 and re.search(rf"\| {num}x \({num}-{num}\) \|$", row), row
