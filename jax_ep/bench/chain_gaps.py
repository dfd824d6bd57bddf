"""Where the time of a chained loop goes: the bench's jitted loop of N calls, traced (JAX profiler), split into each
device operation's duration and the idle gaps between consecutive operations on this process's GPU.

    python -m jax_ep.launch -n 2 -m jax_ep.bench.chain_gaps --ll-tokens 1 --only "dispatch bf16" --nvl 1
    python -m jax_ep.launch -n 4 -m jax_ep.bench.chain_gaps --mode normal --tokens 4096 --only jax_ep --nvl 2

Takes the bench's arguments (python -m jax_ep.bench --help; jax_ep's contenders only, --calls calls per loop); the
low-latency ones unless --mode is given (normal or all). For each contender it prints the loop's period per call
(from consecutive send kernels: one per call, the LL send kernels, normal mode's send-rows or combine-send kernel),
then per operation (name up to its first '(' or '<'): launches, median duration; and per pair of consecutive
operations: the median gap between the first one's end and the second one's start. A period well above the sum of
the durations on it is time the GPU spends idle: launch-bound host work, or a wait outside the kernels.

With JAX_EP_TEST_PHASES=1 in the environment (before initialize) the NVLink kernels (both modes) and the NVSHMEM
low-latency kernels also stamp named points (cuda/common/phase_stamps.cuh) and the report adds, per phase of the
contender's kernels, the mean time from a block's start.
"""

from __future__ import annotations

import os
import re
import statistics
import sys


def short_name(name: str) -> str:
    """A kernel's name without its template and parameter lists and namespaces."""
    head = re.split(r"[(<]", name.replace("(anonymous namespace)::", ""), maxsplit=1)[0].strip()
    return head.rsplit("::", 1)[-1].split(" ")[-1] or name[:40]


def device_ops(events, procs) -> list:
    """The device operations ('X' events of GPU processes) of the trace, sorted by start."""
    from .timeline import _is_device

    return sorted((ev for ev in events if ev.get("ph") == "X" and "dur" in ev
                   and _is_device(procs.get(ev.get("pid"), ""))), key=lambda ev: ev["ts"])


def gap_report(ops) -> tuple[dict, dict, float]:
    """(name -> durations, (name, next name) -> gaps, median period between send kernels) of one GPU's operations
    (the first GPU process in the trace)."""
    if not ops:
        return {}, {}, float("nan")
    pid = ops[0]["pid"]
    mine = [ev for ev in ops if ev["pid"] == pid]
    durs, gaps = {}, {}
    for prev, nxt in zip(mine, mine[1:]):
        a, b = short_name(prev.get("name", "")), short_name(nxt.get("name", ""))
        gaps.setdefault((a, b), []).append(max(0.0, nxt["ts"] - (prev["ts"] + prev["dur"])))
    for ev in mine:
        durs.setdefault(short_name(ev.get("name", "")), []).append(float(ev["dur"]))
    sends = [ev["ts"] for ev in mine if _SEND.search(ev.get("name", ""))]
    periods = [b - a for a, b in zip(sends, sends[1:])]
    return durs, gaps, statistics.median(periods) if periods else float("nan")


# The one kernel per call that starts its data movement: LL dispatch / combine send kernels (a fused op of one
# kernel: that kernel), normal mode's (nvshmem_)send_rows_kernel or send_copy_kernel (through staging on the NVLink
# kernels), combine_push_kernel (NVLink; launched in pull mode too, where it returns at once) and
# nvshmem_combine_send_kernel (not the forwarders, which run after them).
_SEND = re.compile(r"send(_rows|_copy)?_kernel|fused_kernel|combine_push_kernel")


def sweeps_of(args, argv) -> list:
    """The (mode, tokens, experts, ll_mode) sweeps to trace: low latency unless --mode was given on the command line
    (the bench's default, "all", would add normal mode to the documented low-latency commands)."""
    given = any(a == "--mode" or a.startswith("--mode=") for a in argv)
    mode = args.mode if given else "low_latency"
    out = []
    if mode in ("normal", "all"):
        out += [("normal", t, args.experts, "per_expert") for t in args.tokens]
    if mode in ("low_latency", "all"):
        out += [("low_latency", t, args.ll_experts, m) for t in args.ll_tokens for m in args.ll_modes]
    return out


def phase_table(label: str, rows) -> list:
    """Markdown lines of the phase stamps [(name, summed ns, stamps)]: mean us from a block's start per stamp."""
    lines = [f"| phase ({label}) | stamps | mean us from the block's start |"]
    for name, ns, hits in rows:
        if hits:
            lines.append(f"| {name} | {hits} | {ns / hits / 1e3:.2f} |")
    return lines


def _phase_readers(mode: str) -> list:
    """[(label, reader)] of the phase stamps of this mode's kernels when JAX_EP_TEST_PHASES=1 (else []): the native
    module's test_phases (the NVLink kernels of both modes) and, in low-latency mode, the NVSHMEM module's
    test_low_latency_phases where this build has it."""
    if os.environ.get("JAX_EP_TEST_PHASES") != "1":
        return []
    from jax_ep import _native

    readers = [("NVLink kernels", _native.module().test_phases)]
    if mode == "low_latency":
        from jax_ep.runtime import nvshmem as nvshmem_runtime

        try:
            readers.append(("NVSHMEM LL kernels", getattr(nvshmem_runtime.module(), "test_low_latency_phases")))
        except Exception:  # no NVSHMEM module (or no device library) in this build
            pass
    return readers


def main(argv=None) -> int:
    import jax

    from jax_ep.launch import init_from_env

    from .__main__ import _initialize_all, parse_args
    from .contenders import low_latency_contenders, normal_contenders
    from .harness import chained_loop, to_global
    from .kernel_times import trace_events
    from .timeline import _names

    pid, _ = init_from_env()
    if pid != 0:  # one report: rank 0's GPU
        sys.stdout = open("/dev/null", "w")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    args = parse_args(argv, bool(gpus))
    if not gpus:
        print("chain_gaps: needs CUDA GPUs (the profiler's device events); found none")
        return 0
    import numpy as np

    devices = gpus[: args.ranks]
    sweeps = sweeps_of(args, sys.argv[1:] if argv is None else argv)
    _initialize_all(sweeps, args, devices)
    only = [s for s in args.only.split(",") if s]
    rng = np.random.default_rng(args.seed)
    for mode, tokens, experts, ll_mode in sweeps:
        if mode == "normal":
            cases = normal_contenders(devices, tokens, args.hidden, args.topk, experts, rng, backend=args.backend,
                                      num_sms=args.num_sms, with_ragged=False, nvl=args.nvl)
        else:
            cases = low_latency_contenders(devices, tokens, args.hidden, args.topk, experts, rng,
                                           backend=args.backend, num_sms=args.num_sms, with_ragged=False,
                                           ll_mode=ll_mode, nvl=args.nvl, max_tokens=args.ll_max_tokens)
        for case in cases:
            if case.kind != "jax_ep" or (only and not any(s in case.name for s in only)):
                continue
            cargs = tuple(to_global(a, case.mesh, s) for a, s in zip(case.args, case.in_specs))
            loop = chained_loop(case.op, args.calls, case.mesh, case.in_specs, case.feedback).lower(*cargs).compile()
            with case.setting():  # e.g. direct buffers off for a staged variant
                events = trace_events(loop, cargs, iterations=3)
            procs, _ = _names(events)
            durs, gaps, period = gap_report(device_ops(events, procs))
            print(f"\n[{mode} T={tokens} nvl={args.nvl}] {case.name}: period {period:.1f} us per call (send to send)")
            print("| operation | launches | median us |")
            for name, v in sorted(durs.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
                print(f"| {name} | {len(v)} | {statistics.median(v):.1f} |")
            print("| gap after | before | count | median us | max us |")
            for (a, b), v in sorted(gaps.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
                print(f"| {a} | {b} | {len(v)} | {statistics.median(v):.1f} | {max(v):.1f} |")
            for label, read_phases in _phase_readers(mode):  # untraced loops: the stamps of this contender only
                try:
                    read_phases(True)
                    with case.setting():
                        for _ in range(3):
                            jax.block_until_ready(loop(*cargs))
                    print("\n".join(phase_table(label, read_phases(True))))
                except RuntimeError as e:  # e.g. no NVSHMEM device library, or NVSHMEM not running here
                    print(f"no phase stamps ({label}): {str(e).splitlines()[0][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
