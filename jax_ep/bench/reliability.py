"""Long runs and leak checks: python -m jax_ep.bench.reliability

    python -m jax_ep.bench.reliability --steps 10000 --cycles 20        # all visible GPUs form one EP group
    python -m jax_ep.launch -n 2 -m jax_ep.bench.reliability            # one process per GPU

1. long run: `--steps` consecutive steps inside one lax.scan, each a normal-mode dispatch + combine and a
   low-latency dispatch + combine threading one LowLatencyState, with routing made from the step index on the
   device so it changes every step, cycling through three regimes: random (DeepEP-style scores), skewed (a few hot
   experts) and overflow (the normal config's recv_capacity is below what arrives, so rows are dropped). The same
   program runs on the CUDA backend and on the reference backend; per step it records exact counts and f32 sums of
   the outputs (sums of |y| for the combines), and the two runs are compared at EVERY step (counts and
   dispatched-row sums exactly, combine sums within 1e-2 relative: bf16 outputs, f32 sums in another order). The final LowLatencyState must be [2 * steps, 0, 0, 0] on every rank.
2. lifecycle: `--cycles` rounds of initialize -> one step -> finalize, with this device's free memory
   (cudaMemGetInfo, so jax_ep's own buffers count) and the process's resident host memory read after each
   finalize; prints the growth over the cycles (every process, in both process models).
Prints one summary line per part (process 0) and exits non-zero when a check fails. On CPU (no CUDA backend) it
compares the reference backend with itself and skips the memory part, saying so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # CPU: 8 emulated devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m jax_ep.bench.reliability",
                                 description="Long runs (CUDA vs reference at every step) and initialize/finalize "
                                             "leak checks; see the module docstring.")
    ap.add_argument("--steps", type=int, default=10000, help="scan steps of the long run (0: skip it)")
    ap.add_argument("--cycles", type=int, default=20, help="initialize/finalize cycles (0: skip them)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank and step")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    return ap.parse_args(argv)


def _resident_bytes() -> int:
    """This process's resident host memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main(argv=None) -> int:
    a = _args(argv)
    from jax_ep.launch import init_from_env

    pid, _ = init_from_env()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import jax_ep
    from jax_ep import _native

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    devices = sorted(gpus or jax.devices(), key=lambda d: (d.process_index, d.id))
    R, T, H, K = len(devices), a.tokens, a.hidden, a.topk
    E = a.experts_per_rank * R
    mesh = Mesh(np.array(devices), ("ep",))
    backend = "cuda" if gpus and _native.available() else "reference"
    say = print if pid == 0 else (lambda *x, **k: None)
    say(f"jax_ep.bench.reliability: {R} x {devices[0].device_kind}, backend {backend} vs reference, T={T} H={H} "
        f"K={K} E={E}")

    def configs(name):
        # overflow regime: a capacity well below the R * T rows that can arrive
        normal = jax_ep.EPConfig(E, H, K, T, backend=name, recv_capacity=max(1, R * T // 2))
        ll = jax_ep.EPConfig(E, H, K, T, backend=name, low_latency_buffers=True)
        return normal, ll

    def routing(step, regime):
        key = jax.random.fold_in(jax.random.key(7), step)
        key = jax.random.fold_in(key, jax.lax.axis_index("ep"))
        scores = jnp.abs(jax.random.normal(key, (T, E))) + 1.0
        hot = jnp.where(jnp.arange(E) < 3, 50.0, 0.0)  # skewed: three hot experts
        scores = jnp.where(regime == 1, scores + hot, scores)
        idx = jax.lax.top_k(scores, K)[1].astype(jnp.int32)
        drop = jax.random.uniform(jax.random.fold_in(key, 1), (T, K)) < 0.1  # some -1 slots every step
        return jnp.where(drop, -1, idx)

    def step_fn(normal, ll, steps):
        def step(carry, i):
            x0, state = carry
            idx = routing(i, i % 3)
            w = jax.random.uniform(jax.random.fold_in(jax.random.key(3), i), (T, K), jnp.float32)
            # inputs made from the step index: they change every step (nothing is hoisted) and are the same for
            # both backends at every step (outputs are not fed back: an allowed rounding difference in a combine
            # would otherwise make the two runs drift apart)
            x = (x0.astype(jnp.float32) * (1.0 + 0.125 * (i % 7).astype(jnp.float32))).astype(jnp.bfloat16)
            out = jax_ep.dispatch(x, idx, w, normal)
            y, _ = jax_ep.combine(out.recv_x, out.handle, normal)
            lo, state = jax_ep.low_latency_dispatch(x, idx, ll, use_fp8=False, state=state)
            y2, state = jax_ep.low_latency_combine(lo.recv_x, idx, w, lo.handle, ll, state=state)
            f32 = jnp.float32
            record = jnp.stack([out.num_recv_tokens.astype(f32), jnp.sum(out.recv_x.astype(f32)),
                                jnp.sum(jnp.abs(y.astype(f32))), jnp.sum(lo.recv_count).astype(f32),
                                jnp.sum(jnp.abs(y2.astype(f32)))])
            return (x0, state), record

        def body(x):
            (x, state), records = jax.lax.scan(step, (x, jax_ep.low_latency_state(ll)), jnp.arange(steps))
            return records[None], state.value

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    def host(array):
        """The whole global array on this process (one process per GPU: every process gathers every rank's part)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(array, tiled=True))
        return np.asarray(array)

    x0 = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((R * T, H)), jnp.bfloat16),
                        jax.sharding.NamedSharding(mesh, P("ep")))
    ok = True
    if a.steps > 0:
        runs = {}
        for name in (backend, "reference"):
            normal, ll = configs(name)
            jax_ep.initialize(mesh, normal, ll)
            t0 = time.perf_counter()
            records, state = step_fn(normal, ll, a.steps)(x0)
            runs[name] = (host(records).reshape(R, a.steps, 5), host(state).reshape(R, 4), time.perf_counter() - t0)
        (rc, sc, tc), (rr, _, _) = runs[backend], runs["reference"]
        exact = np.array_equal(rc[..., [0, 1, 3]], rr[..., [0, 1, 3]])
        scale = np.maximum(rr[..., [2, 4]], 1.0)  # sums of |y|: no cancellation
        worst = float(np.max(np.abs(rc[..., [2, 4]] - rr[..., [2, 4]]) / scale))
        state_ok = bool((sc == [2 * a.steps, 0, 0, 0]).all())
        dropped = int(np.sum(rr[..., 0] > configs("reference")[0].capacity(R)))
        good = exact and worst < 1e-2 and state_ok and np.isfinite(rc).all()
        ok &= good
        say(f"long run: {a.steps} steps x 4 ops ({tc:.1f} s incl. compile), {backend} vs reference at every step: "
            f"counts and dispatched-row sums {'identical' if exact else 'DIFFER'}, combine sums max relative "
            f"difference {worst:.2e}, final LL state {'[%d, 0, 0, 0]' % (2 * a.steps) if state_ok else sc.tolist()}, "
            f"{dropped} rank-steps with capacity overflow: {'OK' if good else 'FAILED'}")
        jax_ep.finalize()
    if a.cycles > 0:
        if backend != "cuda":
            say("lifecycle: skipped (no CUDA backend here: the check reads GPU memory)")
        else:
            ordinal = int(getattr(devices[[d.process_index for d in devices].index(jax.process_index())],
                                  "local_hardware_id", 0))
            free, rss = [], []
            normal, ll = configs(backend)
            once = step_fn(normal, ll, 1)  # one compiled program for every cycle: it outlives each finalize
            for _ in range(a.cycles):
                jax_ep.initialize(mesh, normal, ll)
                jax.block_until_ready(once(x0))
                jax_ep.finalize()
                free.append(_native.module().device_memory_info(ordinal)[0])
                rss.append(_resident_bytes())
            growth = free[0] - min(free)
            host_growth = max(rss) - rss[0]
            # XLA's pool may round; a leak of jax_ep's buffers is hundreds of MB. Host: the first cycles compile and
            # load; a leak per cycle would grow linearly
            good = growth <= (64 << 20) and host_growth <= (256 << 20)
            ok &= good
            print(f"lifecycle (process {pid}): {a.cycles} x (initialize, one step, finalize): free device memory "
                  f"after each finalize {free[0] / 2**30:.3f} -> {free[-1] / 2**30:.3f} GiB, largest drop after the "
                  f"first {growth / 2**20:.1f} MiB; host resident memory {rss[0] / 2**20:.0f} -> "
                  f"{rss[-1] / 2**20:.0f} MiB (largest growth {host_growth / 2**20:.0f} MiB, over the second half "
                  f"of the cycles {(rss[-1] - rss[len(rss) // 2]) / 2**20:.0f} MiB): "
                  f"{'OK' if good else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
