"""Timeline of one jitted low-latency call: every device operation and the host work around it (JAX profiler).

    python -m jax_ep.bench.timeline --tokens 128 [--program decode|dispatch] [--ll-mode per_rank] [--out DIR]

Runs a decode-step program (LL dispatch fp8 -> an expert transform -> LL combine, one jitted call per step, as a
decode loop calls it) under the profiler and prints, for one steady-state step: each device operation (kernels,
memsets, copies) with its start relative to the step, its duration and the idle gap before it; then the host
threads' longest events in the same window. Also wall time per step when each call is waited for (latency) and
when calls are pipelined (throughput). The raw events of the traced steps go to DIR/timeline_events.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep

from .contenders import AXIS, _setup
from .harness import to_global
from .kernel_times import trace_events

# The kernel that starts a step: the LL dispatch's send (per_rank) or its one fused kernel (per_expert).
_DISPATCH_START = re.compile(r"dispatch_(send|fused)_kernel")


def _program(kind, devices, tokens, hidden, topk, experts, seed, scale=1.0, ll_mode="per_expert"):
    """The decode-step program; `scale` only makes programs of different identity (separate compiles)."""
    ranks, mesh, cfg, idx, x, w = _setup(devices, tokens, hidden, topk, experts, np.random.default_rng(seed),
                                         "cuda", 24, ll_mode)
    spec = P(AXIS)
    jax_ep.initialize(mesh, cfg)

    def decode(x, idx, w):
        out = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True)
        if kind == "dispatch":
            return out.recv_count
        expert_out = (out.recv_x.astype(jnp.float32) * out.recv_x_scales.repeat(128, axis=2) * scale
                      ).astype(jnp.bfloat16)
        return jax_ep.low_latency_combine(expert_out, idx, w, out.handle, cfg)

    fn = jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    return fn, (x, to_global(idx, mesh, spec), w)


def _names(events):
    """pid -> process name, (pid, tid) -> thread name (perfetto metadata events)."""
    procs, threads = {}, {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            procs[ev["pid"]] = ev.get("args", {}).get("name", "")
        elif ev.get("ph") == "M" and ev.get("name") == "thread_name":
            threads[(ev["pid"], ev["tid"])] = ev.get("args", {}).get("name", "")
    return procs, threads


def _is_device(proc_name: str) -> bool:
    return "/device:GPU" in proc_name or "GPU" in proc_name and "host" not in proc_name.lower()


def _timed(fn, args):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e6


def first_call_figures(a, devices):
    """First execution of a freshly compiled program (compile excluded) against its steady calls, without and with
    jax_ep.warmup before it (a different program each, so neither benefits from the other's first run)."""
    rows = []
    for n, warm in enumerate((False, True)):
        fn, args = _program(a.program, devices, a.tokens, a.hidden, a.topk, a.experts, 0, scale=1.0 + n,
                            ll_mode=a.ll_mode)
        compiled = fn.lower(*args).compile()
        if warm:
            jax_ep.warmup(compiled, *args)
        first = _timed(compiled, args)
        second = _timed(compiled, args)
        steady = statistics.median(_timed(compiled, args) for _ in range(30))
        rows.append((warm, first, second, steady))
    for warm, first, second, steady in rows:
        print(f"{a.program} T={a.tokens}: {'after jax_ep.warmup' if warm else 'no warmup          '}: first call "
              f"{first:.0f} us, second {second:.0f} us, steady {steady:.0f} us (median of 30): first / steady = "
              f"{first / steady:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--program", choices=["decode", "dispatch"], default="decode")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ll-mode", choices=["per_expert", "per_rank", "auto"], default="per_expert",
                   help="EPConfig.low_latency_mode of the program")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if not devices:
        print("timeline: needs CUDA GPUs (the profiler's device events); found none")
        return 0
    first_call_figures(a, devices)
    fn, args = _program(a.program, devices, a.tokens, a.hidden, a.topk, a.experts, 0, ll_mode=a.ll_mode)
    jax_ep.warmup(fn, *args, calls=3)
    # wall per step: each call waited for (a decode step's latency), and pipelined (dispatch throughput)
    lat = []
    for _ in range(50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        lat.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(50)]
    jax.block_until_ready(outs)
    pipe = (time.perf_counter() - t0) * 1e6 / 50
    print(f"{a.program} T={a.tokens} on {len(devices)} GPU(s): wall per step {statistics.median(lat):.1f} us "
          f"(each waited for, median of 50), {pipe:.1f} us (50 pipelined calls)")

    events = trace_events(lambda *xs: jax.block_until_ready(fn(*xs)), args, a.steps)  # one waited step each
    procs, threads = _names(events)
    dev = sorted((ev for ev in events if ev.get("ph") == "X" and _is_device(procs.get(ev.get("pid"), ""))),
                 key=lambda ev: ev["ts"])
    starts = [ev["ts"] for ev in dev if _DISPATCH_START.search(ev.get("name", ""))]
    if len(starts) < 3:
        print(f"timeline: found {len(starts)} dispatch-send kernels in the trace; processes: {sorted(set(procs.values()))}")
        return 1
    # one steady step on the first device: from its dispatch send to the next one
    first_pid = next(ev["pid"] for ev in dev if _DISPATCH_START.search(ev.get("name", "")))
    mine = [ev for ev in dev if ev["pid"] == first_pid]
    sends = [ev["ts"] for ev in mine if _DISPATCH_START.search(ev.get("name", ""))]
    lo, hi = sends[-3], sends[-2]
    step = [ev for ev in mine if lo - 50 <= ev["ts"] < hi - 50]
    print(f"\ndevice operations of one step ({procs.get(first_pid, first_pid)}), {hi - lo:.1f} us from send to send:")
    print("| start (us) | duration (us) | gap before (us) | operation | stream |")
    print("|---|---|---|---|---|")
    prev_end = None
    busy = 0.0
    for ev in step:
        gap = "" if prev_end is None else f"{ev['ts'] - prev_end:.1f}"
        busy += ev.get("dur", 0.0)
        print(f"| {ev['ts'] - lo:.1f} | {ev.get('dur', 0.0):.1f} | {gap} | {ev.get('name', '')[:90]} | "
              f"{threads.get((ev['pid'], ev['tid']), ev['tid'])} |")
        prev_end = ev["ts"] + ev.get("dur", 0.0)
    print(f"busy {busy:.1f} us of {hi - lo:.1f} us")
    host = sorted((ev for ev in events if ev.get("ph") == "X" and not _is_device(procs.get(ev.get("pid"), ""))
                   and lo - 100 <= ev["ts"] < hi and ev.get("dur", 0) >= 2.0), key=lambda ev: -ev["dur"])
    print("\nhost events >= 2 us in the same window (longest first):")
    for ev in host[:25]:
        print(f"  {ev['dur']:8.1f} us  at {ev['ts'] - lo:8.1f}  {threads.get((ev['pid'], ev['tid']), ev['tid'])}: "
              f"{ev.get('name', '')[:100]}")
    os.makedirs(a.out, exist_ok=True)
    keep = [ev for ev in events if ev.get("ph") == "M" or sends[0] - 200 <= ev.get("ts", 0) <= sends[-1] + 500]
    with open(os.path.join(a.out, "timeline_events.json"), "w") as f:
        json.dump(keep, f)
    print(f"\nwrote {os.path.join(a.out, 'timeline_events.json')} ({len(keep)} events)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
