"""`python -m jax_ep.bench.first_call` without GPUs: argument errors name the option, the CUDA-only modes exit with
status 2 and say so, and every (op, mode) program builds and runs on the reference backend with the same inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def _run(args, devices=1, timeout=240):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["all_to_all", "eager"])
def test_cuda_only_exits_with_status_2(mode):
    proc = _run(["-m", "jax_ep.bench.first_call", "--op", "low_latency", "--mode", mode, "--tokens", "1"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CUDA only: no CUDA GPU; nothing measured" in proc.stderr, proc.stderr[-2000:]
    assert "PREWARM" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--mode", "xla", "--tokens", "0"], "argument --tokens: must be at least 1, got 0"),
    (["--op", "bogus", "--mode", "eager"], "argument --op: invalid choice: 'bogus'"),
    (["--mode", "eager", "--warmup-calls", "-1"], "argument --warmup-calls: must be at least 0"),
    (["--mode", "eager", "--calls", "two"], "argument --calls: expected an integer, got 'two'"),
    (["--mode", "all_to_all", "--ll-mode", "auto"], "argument --ll-mode: invalid choice: 'auto'"),
    (["--op", "low_latency", "--mode", "eager", "--tokens", "512"], "--tokens (512) must be at most 256"),
    (["--op", "low_latency", "--mode", "eager", "--hidden", "100"], "--hidden (100) must be a multiple of 128"),
    (["--mode", "eager", "--topk", "9", "--experts", "8"], "--topk (9) must be at most --experts (8)"),
    (["--op", "normal"], "the following arguments are required: --mode"),
])
def test_bad_arguments_are_argparse_errors_naming_the_option(args, message):
    proc = _run(["-m", "jax_ep.bench.first_call", *args])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "usage: python -m jax_ep.bench.first_call" in proc.stderr


# Builds every (op, mode) program of first_call with its config on the reference backend, over 4 CPU devices, and
# runs it through jax_ep.warmup and one call; prints what the test checks as one JSON line.
_PROGRAMS = textwrap.dedent("""
    import dataclasses, json
    import jax, numpy as np
    import jax_ep
    from jax_ep.bench import first_call as fc
    from jax_ep.bench.contenders import bench_mesh

    mesh = bench_mesh(jax.devices())
    out = {"defaults": {op: list(fc.DEFAULT_SHAPE[op]) for op in fc.DEFAULT_SHAPE}}
    for op in ("normal", "low_latency"):
        a = fc.parse_args(["--op", op, "--mode", "eager"])
        out["defaults"][op] = [a.tokens, a.experts, a.cfg.low_latency_mode]
    for op, ll_mode in (("normal", "per_expert"), ("low_latency", "per_expert"), ("low_latency", "per_rank")):
        ys = {}
        for mode in ("eager", "all_to_all", "xla"):
            a = fc.parse_args(["--op", op, "--mode", mode, "--ll-mode", ll_mode, "--tokens", "8", "--hidden", "256",
                               "--experts", "16", "--topk", "4"])
            cfg = dataclasses.replace(a.cfg, backend="reference")
            prog, args = fc.build_program(op, mode, cfg, mesh)
            compiled = prog.lower(*args).compile()
            jax_ep.warmup(compiled, *args, calls=2)
            y = np.asarray(jax.block_until_ready(compiled(*args)), np.float32)
            ys[mode] = y
            out[f"{op} {cfg.low_latency_mode} {mode}"] = {
                "inputs": [list(x.shape) for x in args], "out": list(y.shape), "finite": bool(np.isfinite(y).all())}
        if op == "normal":  # unweighted combine of the dispatch = the padded all_to_all's sum over ranks
            out["normal eager == all_to_all"] = bool(np.allclose(ys["eager"], ys["all_to_all"], rtol=1e-2))
    print("RESULT " + json.dumps(out))
""")


def test_programs_build_and_run_on_the_reference_backend():
    proc = _run(["-c", _PROGRAMS], devices=4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["defaults"] == {"normal": [4096, 256, "per_expert"], "low_latency": [128, 288, "per_expert"]}
    assert out["normal eager == all_to_all"]
    R, T, H, K, E = 4, 8, 256, 4, 16
    common = [[R * T, H], [R * T, K], [R * T, K]]
    for op, ll_mode in (("normal", "per_expert"), ("low_latency", "per_expert"), ("low_latency", "per_rank")):
        for mode in ("eager", "all_to_all", "xla"):
            got = out[f"{op} {ll_mode} {mode}"]
            # low_latency: the combine's expert output [R * E/R, R*T, H] is an input of every mode's program
            inputs = common + ([[E, R * T, H]] if op == "low_latency" else [])
            assert got == {"inputs": inputs, "out": [R * T, H], "finite": True}, (op, ll_mode, mode, got)


def test_markdown_row_starts_with_op_and_tokens():
    script = textwrap.dedent("""
        from jax_ep.bench.first_call import markdown_row
        row = {"op": "low_latency", "ll_mode": "per_rank", "T": 1, "process_model": "multi-process",
               "mode": "all_to_all", "initialize_steps_ms": {}, "lower_s": 0.5, "compile_s": 1.25,
               "first_call_s": 3e-4, "second_call_s": 1e-4, "steady_s": 1e-4, "first_over_steady": 3.0,
               "env": {"warmup_calls": 2}}
        print(markdown_row(row))
    """)
    proc = _run(["-c", script])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ('| low_latency (per_rank) | 1 | multi-process | all_to_all | - | {} | 500.0 | '
                                   '1250.0 | 300 | 100 | 100 | 3.00 | {"warmup_calls": 2} |')
