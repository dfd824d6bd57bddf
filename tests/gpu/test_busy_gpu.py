"""Low-latency and normal-mode ops at a large T while every GPU is busy with another stream's work.

The risk tested: receiving blocks spin on flags or counters, and a kernel whose blocks cannot all be resident at once
(other work holds the SMs) must still finish. The low-latency receive grids are at most one wave
(low_latency_device.cuh combine_recv_grid) and wait only for send kernels queued before them on every GPU; the
normal-mode two-role kernels (push combine, cached dispatch's send_copy_kernel) take roles in start order, so a
block that spins has seen every sender of its grid start. The tests expect correct results and no device timeout; a
launch shape that starves would trap ("jax_ep: timeout ...") or hang until timeout_seconds. The busy work drains by
itself, so a kernel that only stalls until it ends passes: these are progress and correctness checks, not proof of
the progress argument.

The busy work is torch matmuls on a side stream of each GPU, in this process (torch and XLA share the primary
context, so their kernels run concurrently). A test fails if that work ended before the jax_ep ops did: then it
would have proven nothing. Oracle: the reference backend on the same inputs (low latency: recv_count, src_info
bit-identical, y within bf16 tolerance; normal mode: num_recv_tokens bit-identical, y and dx within bf16 tolerance).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from cuda_backend_harness import rel_error, require, upto

E, H, K = 64, 1024, 8
T_MAX = 4096  # far above 2x the SM count: the receive kernels' token loops take many tokens per block


def _torch_cuda():
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        pytest.skip(f"needs torch with CUDA for the busy stream ({type(e).__name__}: {e})")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA for the busy stream (torch.cuda.is_available() is False)")
    return torch


def _busy(torch, num_gpus: int, seconds: float):
    """Queues about `seconds` of matmuls on a side stream of each GPU; returns the events that mark their ends."""
    ends = []
    for d in range(num_gpus):
        with torch.cuda.device(d):
            a = torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16)
            stream = torch.cuda.Stream(device=d)
            start, probe = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):  # a warm batch, a timed one, then enough batches for `seconds`
                for _ in range(10):
                    a = (a @ a) * 1e-3
                start.record(stream)
                for _ in range(10):
                    a = (a @ a) * 1e-3
                probe.record(stream)
            probe.synchronize()
            per_batch = max(start.elapsed_time(probe) / 1e3, 1e-4)
            with torch.cuda.stream(stream):
                for _ in range(int(seconds / per_batch) + 1):
                    for _ in range(10):
                        a = (a @ a) * 1e-3
                end = torch.cuda.Event()
                end.record(stream)
            ends.append(end)
    return ends


def _program(cfg, mesh):
    def body(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        expert_out = (out.recv_x.astype(jnp.float32) * 1.5).astype(jnp.bfloat16)
        y = jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)
        return y, out.recv_count, out.handle.src_info

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))


def _routing_inputs(R: int, seed: int, extra_rows: int = 0):
    """x [R T_MAX, H] bf16, top-K distinct experts per token, their weights, then `extra_rows` more [R T_MAX, H] bf16
    arrays (e.g. a cotangent)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(R * T_MAX, H)), jnp.bfloat16)
    idx = jnp.asarray(np.argsort(-rng.random((R * T_MAX, E)), axis=1)[:, :K].astype(np.int32))
    w = jnp.asarray(rng.random((R * T_MAX, K)).astype(np.float32))
    return (x, idx, w) + tuple(jnp.asarray(rng.normal(size=(R * T_MAX, H)), jnp.bfloat16) for _ in range(extra_rows))


def _run_while_busy(torch, name: str, R: int, run, arg_sets, calls: int):
    """`calls` calls of the compiled, warm `run` while every GPU's side stream is busy, call i on
    arg_sets[i % len(arg_sets)]; their results. Fails if the busy work ended before the calls did (the test would
    have proven nothing)."""
    ends = _busy(torch, R, seconds=3.0)
    t0 = time.perf_counter()
    results = [run(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
    jax.block_until_ready(results)
    elapsed = time.perf_counter() - t0
    still_busy = [not e.query() for e in ends]
    print(f"{name}: {calls} calls at T={T_MAX} on {R} GPUs in {elapsed:.2f} s; busy streams still running at the end: "
          f"{still_busy}")
    assert any(still_busy), "the busy work ended before the jax_ep calls did: the test proved nothing"
    return results


@pytest.mark.parametrize("mode", ["per_expert", "per_rank"])
def test_low_latency_at_large_tokens_with_busy_gpus(mode):
    require(2)
    R = upto(4)
    torch = _torch_cuda()
    mesh = Mesh(np.array(jax.devices("gpu")[:R]), ("ep",))
    cfg = jax_ep.EPConfig(E, H, K, T_MAX, backend="cuda", timeout_seconds=20.0, low_latency_mode=mode,
                          low_latency_buffers=True)
    ref = jax_ep.EPConfig(E, H, K, T_MAX, backend="reference", low_latency_mode=mode)
    jax_ep.initialize(mesh, cfg, ref, warmup_ops=False)
    try:
        args = _routing_inputs(R, 5)
        run, oracle = _program(cfg, mesh), _program(ref, mesh)
        want = jax.device_get(oracle(*args))
        jax.block_until_ready(run(*args))  # compiled and warm before the GPUs get busy
        results = _run_while_busy(torch, mode, R, run, [args], calls=20)
        got = jax.device_get(results[-1])
        for r in results[:-1]:
            np.testing.assert_array_equal(np.asarray(jax.device_get(r[1])), want[1])
        np.testing.assert_array_equal(got[1], want[1], err_msg="recv_count")
        np.testing.assert_array_equal(got[2], want[2], err_msg="src_info")
        assert rel_error(got[0], want[0]) <= 2 ** -7, f"combine relative error {rel_error(got[0], want[0]):.2e}"
        torch.cuda.synchronize()
    finally:
        jax_ep.finalize()


def _normal_program(cfg, mesh):
    """dispatch -> expert transform -> combine and its gradient: the forward combine and the gradient of dispatch run
    push combine, the gradient of combine runs cached dispatch (send_copy_kernel on the NVLink kernels)."""
    def body(x, idx, w, g):
        def forward(x):
            out = jax_ep.dispatch(x, idx, w, cfg)
            y, _ = jax_ep.combine((out.recv_x.astype(jnp.float32) * 1.5).astype(jnp.bfloat16), out.handle, cfg)
            return y, out.num_recv_tokens

        y, pullback, received = jax.vjp(forward, x, has_aux=True)
        (dx,) = pullback(g)
        return y, dx, received[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))


def test_normal_mode_two_role_kernels_with_busy_gpus():
    """The normal-mode kernels whose blocks split into senders and spinning receivers (push combine, cached dispatch
    through staging) while another stream holds most SMs: they finish, with the reference backend's results."""
    require(2)
    R = upto(4)
    torch = _torch_cuda()
    mesh = Mesh(np.array(jax.devices("gpu")[:R]), ("ep",))
    cfg = jax_ep.EPConfig(E, H, K, T_MAX, backend="cuda", timeout_seconds=20.0)
    ref = jax_ep.EPConfig(E, H, K, T_MAX, backend="reference")
    jax_ep.initialize(mesh, cfg, ref, warmup_ops=False)
    try:
        # two input sets, alternated: a call that read rows before they landed would find the other set's
        arg_sets = [_routing_inputs(R, seed, extra_rows=1) for seed in (6, 7)]  # x, idx, w, the cotangent of y
        run, oracle = _normal_program(cfg, mesh), _normal_program(ref, mesh)
        wants = [jax.device_get(oracle(*args)) for args in arg_sets]
        jax.block_until_ready(run(*arg_sets[0]))  # compiled and warm before the GPUs get busy
        results = _run_while_busy(torch, "normal", R, run, arg_sets, calls=10)
        for i, result in enumerate(results):
            got, want = jax.device_get(result), wants[i % 2]
            np.testing.assert_array_equal(got[2], want[2], err_msg=f"num_recv_tokens, call {i}")
            for name, k in (("combine", 0), ("gradient", 1)):
                err = rel_error(got[k], want[k])
                assert err <= 2 ** -7, f"call {i}: {name} relative error {err:.2e}"
        torch.cuda.synchronize()
    finally:
        jax_ep.finalize()
