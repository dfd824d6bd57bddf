"""XLA command buffers (CUDA graphs) and the low-latency ops, on the GPUs (docs/API.md, "Command buffers").

Runs tests/programs/gpu/command_buffer_decode.py (a jitted decode step: low-latency dispatch fp8, an expert
transform, low-latency combine, every GPU of one process) three times: command buffers off
(--xla_gpu_enable_command_buffer=), XLA's default, and with custom calls allowed in them and no minimum size
(--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1). Checks that the output is the
same in all three, that with CUSTOM_CALL no jax_ep handler is called once the command buffer (a CUDA graph XLA
records on the second execution) replays, while with command buffers off both (dispatch and combine) are called on
every GPU every step (jax_ep._native's handler-call count; XLA forms command buffers from thunks, so the optimized
HLO does not show them), and that the kernels still run every step (profile). Prints each variant's wall time per
step (waited for, and queued) for docs/API.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import cuda_gpu_count, gpu_child_env, gpu_skip_reason  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "tests", "programs", "gpu", "command_buffer_decode.py")
# custom_call: also --xla_gpu_graph_min_graph_size=1, since XLA forms no command buffer for a sequence shorter than
# that size (5 by default), and a decode step of one MoE layer is shorter.
VARIANTS = {"off": "--xla_gpu_enable_command_buffer=", "default": "",
            "custom_call": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"}


def _run(variant: str, tokens: int) -> dict:
    env = gpu_child_env(XLA_FLAGS=VARIANTS[variant])
    p = subprocess.run([sys.executable, PROGRAM, "--variant", variant, "--tokens", str(tokens)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{variant}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    m = re.search(r"RESULT decode process=0 (.*)", p.stdout)
    assert m, p.stdout[-3000:]
    fields = dict(kv.split("=", 1) for kv in m.group(1).split())
    print(f"{variant:12s} " + " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("variant",)))
    return fields


@pytest.mark.parametrize("tokens", [1, 128])
def test_decode_step_runs_from_cuda_graphs_with_custom_calls_in_command_buffers(tokens):
    reason = gpu_skip_reason(2, cuda_gpu_count())
    if reason:
        pytest.skip(reason)
    runs = {v: _run(v, tokens) for v in VARIANTS}
    checksums = {v: r["checksum"] for v, r in runs.items()}
    assert len(set(checksums.values())) == 1, checksums  # the same outputs whatever XLA does with the step
    off, custom = runs["off"], runs["custom_call"]
    ranks = int(off["ranks"])
    # one handler call per op (dispatch and combine, each launching its send and receive), on every GPU, every step
    assert float(off["handler_calls_per_step"]) == 2 * ranks, off
    # replayed from the CUDA graph: XLA may record it again when a step's buffers move (once in 100 steps seen)
    assert float(custom["handler_calls_per_step"]) <= 0.1 * 2 * ranks, custom
    for r in runs.values():  # the kernels run every step, from a graph replay or not
        assert float(r["jax_ep_kernels_per_step"]) >= 2 * int(r["ranks"]), r
