"""What jax_ep.initialize buys: `jax_ep.initialize` step times, first-call vs steady-state latency, and the same
without `initialize` (the runtime is then made at trace time).

    python -m jax_ep.bench.first_call --mode eager                       # one process driving all local GPUs
    python -m jax_ep.bench.first_call --mode lazy
    python -m jax_ep.bench.first_call --mode xla                         # control: plain XLA program, no jax_ep
    python -m jax_ep.launch -n 4 -m jax_ep.bench.first_call --mode eager  # one process per GPU (NVSHMEM)
    python -m jax_ep.launch -n 4 -m jax_ep.bench.first_call --mode lazy

Run each mode in a fresh process (NVSHMEM, once up, stays up in a process). lazy starts from a runtime for another
config on the same mesh, so the program's config is added while it is traced (jax_ep never guesses devices: with
no runtime at all a traced op asks for jax_ep.initialize). The program is
one normal-mode dispatch + combine (bf16, CUDA backend) inside jit(shard_map) over all GPUs. Reported (process 0;
with several processes every timed step starts after a cross-process barrier, and the max over processes is shown):
  initialize   wall time of jax_ep.initialize and its steps (Runtime.timings)   [eager]
  lower        tracing + lowering (includes the trace-time initialize in lazy mode)
  compile      XLA compilation
  first call   wall time of the first execution of the compiled program (compile excluded)
  second call  the second execution (XLA records its CUDA graph there when command buffers are on)
  steady       median wall time of the --calls executions after those two
Prints a Markdown table row per mode and one JSON line (`PREWARM {...}`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m jax_ep.bench.first_call",
        description="What jax_ep.initialize buys: jax_ep.initialize step times and first-call vs steady-state latency "
                    "of a compiled dispatch + combine program. CUDA only (needs GPUs and the built extension); on "
                    "CPU it says so and exits with status 2.")
    ap.add_argument("--mode", choices=["eager", "lazy", "xla"], required=True,
                    help="eager: jax_ep.initialize before tracing; lazy: the program's config is added to a runtime "
                         "at trace time; xla: a plain XLA program of the same inputs and output shape (control)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20, help="executions for the steady-state median")
    ap.add_argument("--num-sms", type=int, default=24)
    ap.add_argument("--no-warmup-ops", action="store_true",
                    help="eager mode: jax_ep.initialize(..., warmup_ops=False), no warm-up execution of the ops")
    a = ap.parse_args(argv)

    from jax_ep.launch import init_from_env

    pid, nproc = init_from_env()
    import jax

    from jax_ep import _native

    if not [d for d in jax.devices() if d.platform == "gpu"] or not _native.available():
        why = "no CUDA GPU" if _native.available() else f"the native extension is unavailable ({_native.load_error()})"
        print(f"python -m jax_ep.bench.first_call: CUDA only: {why}; nothing measured", file=sys.stderr)
        return 2

    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_ep

    from .contenders import deepep_routing
    from .harness import to_global

    def sync(name):
        if nproc > 1:
            multihost_utils.sync_global_devices(f"jax_ep_first_call_{name}")

    def slowest(seconds):
        if nproc == 1:
            return seconds
        return float(np.max(multihost_utils.process_allgather(np.float64(seconds))))

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    R, T, H, K, E = len(devices), a.tokens, a.hidden, a.topk, a.experts
    mesh = Mesh(np.array(devices), ("ep",))
    cfg = jax_ep.EPConfig(E, H, K, T, backend="cuda", num_sms=a.num_sms)

    rng = np.random.default_rng(0)
    idx = deepep_routing(rng, R, T, E, K)
    w = rng.random(size=idx.shape).astype(np.float32)
    sh = NamedSharding(mesh, P("ep"))
    x = jax.jit(lambda k: jax.random.normal(k, (R * T, H), jnp.bfloat16), out_shardings=sh)(jax.random.key(1))
    args = (x, to_global(idx, mesh, P("ep")), to_global(w, mesh, P("ep")))

    def body(x, idx, w):
        if a.mode == "xla":  # control: a plain XLA program with the same inputs and output, no jax_ep
            return (x.astype(jnp.float32) * w[:, :1]).astype(x.dtype) + idx[:, :1].astype(x.dtype)
        out = jax_ep.dispatch(x, idx, w, cfg)
        y, _ = jax_ep.combine(out.recv_x, out.handle, cfg)
        return y

    prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    row = {"mode": a.mode, "processes": nproc, "gpus": R, "T": T, "H": H, "K": K, "E": E,
           "device": devices[0].device_kind}

    sync("start")
    if a.mode == "lazy":
        # trace-time initialize extends a runtime on the program's mesh (jax_ep never guesses devices): start from a
        # runtime for another config, so the config of `prog` is added (buffers, peer access) while it is traced
        jax_ep.initialize(mesh, jax_ep.EPConfig(E, H, K, min(T, 16), backend="cuda", num_sms=a.num_sms),
                          warmup_ops=False)
        sync("lazy_runtime")
    if a.mode == "eager":
        t = time.perf_counter()
        rt = jax_ep.initialize(mesh, cfg, warmup_ops=not a.no_warmup_ops)
        row["initialize_s"] = slowest(time.perf_counter() - t)
        row["initialize_steps_ms"] = {k: round(v * 1e3, 2) for k, v in rt.timings.items()}
        sync("initialized")
    t = time.perf_counter()
    lowered = prog.lower(*args)
    row["lower_s"] = slowest(time.perf_counter() - t)
    rt = jax_ep.runtime.current()
    if a.mode == "lazy":
        row["initialize_steps_ms"] = {k: round(v * 1e3, 2) for k, v in rt.timings.items()}
    if rt is None:  # xla control
        row["initialize_steps_ms"] = {}
        row["process_model"] = "multi-process" if nproc > 1 else "single-process"
        row["transport"] = "none (plain XLA)"
    else:
        row["process_model"], row["transport"] = rt.process_model, rt.transport
    t = time.perf_counter()
    compiled = lowered.compile()
    row["compile_s"] = slowest(time.perf_counter() - t)
    times = []
    for i in range(a.calls + 2):
        sync(f"call{i}")
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    row["first_call_s"] = slowest(times[0])
    row["second_call_s"] = slowest(times[1])
    row["steady_s"] = slowest(statistics.median(times[2:]))
    row["env"] = {k: os.environ[k] for k in ("CUDA_MODULE_LOADING", "XLA_FLAGS") if os.environ.get(k)}
    if a.mode == "eager":
        row["env"]["warmup_ops"] = not a.no_warmup_ops
    row["first_over_steady"] = row["first_call_s"] / row["steady_s"]
    if pid == 0:
        print(f"PREWARM {json.dumps(row)}", flush=True)
        init = f"{row['initialize_s'] * 1e3:.1f}" if "initialize_s" in row else "-"
        print(f"| {row['process_model']} | {a.mode} | {init} | {json.dumps(row['initialize_steps_ms'])} | "
              f"{row['lower_s'] * 1e3:.1f} | {row['compile_s'] * 1e3:.1f} | {row['first_call_s'] * 1e6:.0f} | "
              f"{row['second_call_s'] * 1e6:.0f} | {row['steady_s'] * 1e6:.0f} | {row['first_over_steady']:.2f} | "
              f"{json.dumps(row['env'])} |", flush=True)
    jax_ep.finalize()


if __name__ == "__main__":
    sys.exit(main())
