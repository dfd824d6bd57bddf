"""python -m jax_ep.bench: jax_ep against the JAX collectives a user has today, in one harness and one run.

    python -m jax_ep.bench --mode normal --tokens 512,1024,2048,4096      # DeepEP's normal-mode shapes
    python -m jax_ep.bench --mode low_latency                               # T=128 H=7168 K=8 E=288
    python -m jax_ep.bench --out bench_out                                  # JSON + PNG plot there

Method (docs/BENCHMARKS.md, "Method"): per op, a jitted, unrolled loop of N chained calls, wall time / N, median of several loops;
bandwidth = bytes of rows this rank receives (local rows included; fp8 counts 1 byte per element + 4 per 128
channels) / time, averaged over ranks. Without GPUs it runs small shapes on 8 emulated CPU devices and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

import jax_ep  # noqa: E402
import numpy as np  # noqa: E402

from .contenders import low_latency_contenders, normal_contenders  # noqa: E402
from .harness import measure, prepare_op  # noqa: E402


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each option's default after its help (unless the help states it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, "", argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def parse_args(argv, on_gpu):
    p = argparse.ArgumentParser(prog="python -m jax_ep.bench", description=__doc__,
                                formatter_class=_Formatter)
    p.add_argument("--mode", choices=["normal", "low_latency", "all"], default="all", help="which ops to time")
    p.add_argument("--tokens", default=None, help="comma-separated tokens per rank (normal mode sweep; default 4096 on GPUs, 16,64 on CPU)")
    p.add_argument("--ll-tokens", default=None, help="comma-separated tokens per rank (low-latency sweep; default 128 on GPUs, 16 on CPU)")
    p.add_argument("--ll-mode", default="per_expert",
                   help="comma-separated EPConfig.low_latency_mode values to run (per_expert, per_rank, auto), or "
                        "nvshmem: per_expert with allow_nvlink_for_low_latency=False (NVSHMEM puts; one process per "
                        "GPU, e.g. JAX_EP_TRANSPORT=nvshmem python -m jax_ep.launch -n 1 -m jax_ep.bench ...; not "
                        "together with the other values: the configs of one axis must agree)")
    p.add_argument("--ll-max-tokens", type=int, default=None,
                   help="max_tokens_per_rank (T_max) of the low-latency configs, at least every --ll-tokens value: "
                        "calls of fewer tokens than the config holds, as a decoder sized for its largest batch makes "
                        "(default: each --ll-tokens value)")
    p.add_argument("--hidden", type=int, default=7168 if on_gpu else 256, help="H, channels per token (default 7168 on GPUs, 256 on CPU)")
    p.add_argument("--topk", type=int, default=8 if on_gpu else 4, help="K, experts per token (default 8 on GPUs, 4 on CPU)")
    p.add_argument("--experts", type=int, default=256 if on_gpu else 32, help="E of the normal-mode configs (default 256 on GPUs, 32 on CPU)")
    p.add_argument("--ll-experts", type=int, default=288 if on_gpu else 32, help="E of the low-latency configs (default 288 on GPUs, 32 on CPU)")
    p.add_argument("--ranks", type=int, default=None, help="EP size (default: all devices)")
    p.add_argument("--calls", type=int, default=20, help="chained calls per timed loop (N >= 20)")
    p.add_argument("--loops", type=int, default=5, help="timed loops per round; the median is reported")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds: every contender of a sweep is timed once per round, in turn (interleaved); the "
                        "table gives the median of the rounds and, for ratios, their median with min-max")
    p.add_argument("--num-sms", type=int, default=24, help="EPConfig.num_sms of the normal-mode kernels")
    p.add_argument("--nvl", type=int, default=8,
                   help="EPConfig.num_max_nvl_peers; below the EP size the low-latency ops run the NVSHMEM kernels "
                        "with NVSHMEM puts between the simulated nodes (one process per GPU; docs/INTERNODE.md)")
    p.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto", help="EPConfig.backend of jax_ep's contenders")
    p.add_argument("--no-warmup-ops", action="store_true",
                   help="jax_ep.initialize(..., warmup_ops=False): no warm-up execution of the ops before the first call "
                        "(to see what it buys in the 'first call / steady' column)")
    p.add_argument("--marginal", action="store_true",
                   help="also time each loop with 2N calls and report (t(2N) - t(N)) / N, what an added call costs "
                        "without the loop's launch and wait (docs/BENCHMARKS.md, Method)")
    p.add_argument("--only", default="", help="comma-separated substrings: run only matching contenders (default: all)")
    p.add_argument("--out", default="bench_out", help="folder for results.json and the plots")
    p.add_argument("--seed", type=int, default=0, help="seed of the random routing and inputs")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in (args.tokens or ("4096" if on_gpu else "16,64")).split(",")]
    args.ll_tokens = [int(t) for t in (args.ll_tokens or ("128" if on_gpu else "16")).split(",")]
    args.ll_modes = [m for m in args.ll_mode.split(",") if m]
    for m in args.ll_modes:
        if m not in ("per_expert", "per_rank", "auto", "nvshmem"):
            p.error(f"--ll-mode: {m!r} is not one of per_expert, per_rank, auto, nvshmem")
    if "nvshmem" in args.ll_modes and len(args.ll_modes) > 1:
        p.error("--ll-mode nvshmem runs alone (the configs of one mesh axis must agree on "
                "allow_nvlink_for_low_latency)")
    if args.ll_max_tokens is not None and args.ll_max_tokens < max(args.ll_tokens):
        p.error(f"--ll-max-tokens {args.ll_max_tokens} is below --ll-tokens {max(args.ll_tokens)}")
    if args.repeat < 1 or args.loops < 1:
        p.error(f"--repeat and --loops must be at least 1, got --repeat {args.repeat} --loops {args.loops}")
    return args


def main(argv=None):
    from jax_ep.launch import init_from_env

    pid, nproc = init_from_env()  # under `python -m jax_ep.launch -n N`: one process per GPU; else (0, 1)
    if pid != 0:  # one table / one results.json for the job: the other ranks only take part
        sys.stdout = open(os.devnull, "w")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    args = parse_args(argv, bool(gpus))
    devices = (gpus or jax.devices("cpu"))[: args.ranks]
    machine = (f"{len(gpus)}x {gpus[0].device_kind}" if gpus else
               f"{len(devices)} emulated CPU devices on {platform.machine()} (small shapes; not GPU numbers)")
    model = f"multi-process ({nproc} processes, jax_ep.launch)" if nproc > 1 else "single process"
    print(f"jax_ep.bench on {machine}; jax {jax.__version__}; process model: {model}")
    with_ragged = bool(gpus) and nproc == 1
    if not gpus:
        print("note: XLA:CPU has no ragged_all_to_all, so the ragged baselines are skipped on CPU")
    elif nproc > 1:
        print("note: ragged_all_to_all cannot run with one process per GPU (XLA: 'RaggedAllToAll fallback to NCCL is "
              "not allowed'), so the ragged baselines are skipped; the padded all_to_all runs")
    rng = np.random.default_rng(args.seed)
    only = [s for s in args.only.split(",") if s]
    results = []
    sweeps = []
    if args.mode in ("normal", "all"):
        sweeps += [("normal", t, args.experts, "per_expert") for t in args.tokens]
    if args.mode in ("low_latency", "all"):
        sweeps += [("low_latency", t, args.ll_experts, m) for t in args.ll_tokens for m in args.ll_modes]
    pools = _initialize_all(sweeps, args, devices)
    if pools:  # one process per GPU: whether dispatch takes direct receive (docs/API.md, "Direct buffers")
        print(f"receive pools: {pools}")
        model += f"; receive pools {pools}"
    for mode, tokens, experts, ll_mode in sweeps:
        if mode == "normal":
            cases = normal_contenders(devices, tokens, args.hidden, args.topk, experts, rng, backend=args.backend,
                                      num_sms=args.num_sms, with_ragged=with_ragged, nvl=args.nvl)
        else:
            cases = low_latency_contenders(devices, tokens, args.hidden, args.topk, experts, rng,
                                           backend=args.backend, num_sms=args.num_sms, with_ragged=with_ragged,
                                           ll_mode=ll_mode, nvl=args.nvl, max_tokens=args.ll_max_tokens)
        cases = [c for c in cases if not only or any(s in c.name for s in only)]
        results += _time_cases(cases, mode, tokens, experts, args,
                               (args.ll_max_tokens or tokens) if mode == "low_latency" else tokens)
    if gpus and args.mode in ("low_latency", "all") and not only:
        results += low_latency_phases(devices, args, rng)
    print_table(results)
    if pid == 0:
        write_outputs(results, args, machine, model)
    return 0


def _prepare(case, args):
    """The case's compiled loop (harness.prepare_op), rolled when the unrolled loop runs out of memory."""
    try:
        return prepare_op(case.name, case.op, case.args, case.mesh, case.in_specs, case.feedback,
                          num_calls=args.calls, loops=args.loops, first_call=case.first_call,
                          marginal=args.marginal)
    except Exception as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # N unrolled calls keep N sets of buffers alive; a rolled loop needs one (and pays XLA's per-iteration host
        # round trip, ~50 us: negligible for the ops that big)
        print("    out of memory unrolled; timing a rolled loop instead", flush=True)
        case.name += " (rolled loop)"
        return prepare_op(case.name, case.op, case.args, case.mesh, case.in_specs, case.feedback,
                          num_calls=args.calls, loops=args.loops, first_call=case.first_call, unroll=False,
                          marginal=args.marginal)


def _time_cases(cases, mode, tokens, experts, args, max_tokens):
    """Every case of one sweep compiled first, then timed in `args.repeat` rounds, each round timing every case in
    turn (`args.loops` loops each): contenders interleaved, so drift between rounds hits all of them alike. A case's
    time is the median of its rounds' medians; reps_us keeps each round's, loops_us every loop's."""
    prepared, results = [], []
    for i, case in enumerate(cases):
        print(f"[{mode} T={tokens}] {i + 1}/{len(cases)} {case.name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            with case.setting():  # e.g. direct buffers off for a staged variant
                prepared.append((case, _prepare(case, args), []))
        except Exception as e:  # a baseline XLA cannot run is reported, not fatal
            print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            results.append(dict(mode=mode, tokens=tokens, name=case.name, kind=case.kind, error=str(e)[:500]))
            continue
        print(f"    compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
    marginal_reps = {id(prep): [] for _, prep, _ in prepared}
    for rep in range(args.repeat):
        for case, prep, reps in prepared:
            with case.setting():
                samples = measure(prep, args.loops)
            reps.append(statistics.median(samples))
            if prep.marginal:
                marginal_reps[id(prep)].append(statistics.median(prep.marginal))
            prep.loops_us.extend(s * 1e6 for s in samples)
            spread = (max(samples) - min(samples)) / reps[-1]
            prep.loop_spread = spread
            print(f"[{mode} T={tokens}] round {rep + 1}/{args.repeat} {case.name}: {reps[-1] * 1e6:9.1f} us "
                  f"(spread {spread:.0%})", flush=True)
    for case, prep, reps in prepared:
        us = statistics.median(reps) * 1e6
        gbps = case.bytes_received / us / 1e3
        # over the rounds; with one round, over its loops
        spread = (max(reps) - min(reps)) / statistics.median(reps) if len(reps) > 1 else prep.loop_spread
        results.append(dict(mode=mode, tokens=tokens, max_tokens=max_tokens, hidden=args.hidden, topk=args.topk, experts=experts,
                            nvl=args.nvl, ranks=case.mesh.devices.size, name=case.name, kind=case.kind,
                            op=case.op_kind, us=us, gbps=gbps, spread=spread, reps_us=[r * 1e6 for r in reps],
                            loops_us=[round(v, 2) for v in prep.loops_us],
                            first_call_us=None if prep.first_call is None else prep.first_call * 1e6,
                            marginal_us=(statistics.median(marginal_reps[id(prep)]) * 1e6
                                         if marginal_reps[id(prep)] else None),
                            marginal_reps_us=[m * 1e6 for m in marginal_reps[id(prep)]],
                            single_call_us=None if prep.single_call is None else prep.single_call * 1e6,
                            bytes_received=case.bytes_received))
    return results


def _initialize_all(sweeps, args, devices):
    """One initialize with every config of the run, before the first sweep: the runtime is sized once (largest
    normal region + largest low-latency region) instead of growing (and retiring buffers) at every sweep. Returns
    the receive pools per axis with one process per GPU ("on" / "off: why"), else None."""
    from .contenders import bench_config, bench_mesh

    configs = [bench_config(tokens, args.hidden, args.topk, experts, args.backend, args.num_sms, ll_mode, args.nvl,
                            args.ll_max_tokens if mode == "low_latency" else None)
               for mode, tokens, experts, ll_mode in sweeps]
    if not configs:
        return None
    rt = jax_ep.initialize(bench_mesh(devices), *configs, warmup_ops=not args.no_warmup_ops)
    summary = getattr(getattr(rt, "transport_state", None), "summary", None)
    return summary().get("receive_pools") if summary is not None else None


def low_latency_phases(devices, args, rng):
    """Send / receive kernel times of the LL ops (profiler), for each LL token count."""
    from .contenders import low_latency_phase_programs
    from .kernel_times import kernel_times

    # substrings of both modes' kernel names (low_latency_dispatch_send_kernel, low_latency_per_rank_dispatch_recv_kernel,
    # ...); a fused op of one kernel (per_expert's, per_rank's combine) is named once, send and receive together
    patterns = {"LL dispatch, send and receive (fused kernel)": "dispatch_fused_kernel",
                "LL combine, send and receive (fused kernel)": "combine_fused_kernel",
                "LL dispatch send (kernel)": "dispatch_send_kernel",
                "LL dispatch recv (kernel)": "dispatch_recv_kernel",
                "LL combine send (kernel)": "combine_send_kernel",
                "LL combine recv (kernel)": "combine_recv_kernel"}
    rows = []
    for tokens in args.ll_tokens:
        for ll_mode in args.ll_modes:
            tag = "" if ll_mode == "per_expert" else f" [{ll_mode}]"
            try:
                fn, fargs = low_latency_phase_programs(devices, tokens, args.hidden, args.topk, args.ll_experts,
                                                       rng, args.num_sms, ll_mode, args.nvl, args.ll_max_tokens)
                times = kernel_times(fn, fargs, patterns)
            except Exception as e:  # the profiler is optional: say why there are no phase times
                print(f"[low_latency T={tokens}{tag}] no kernel times: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}")
                continue
            for label, (count, us) in times.items():
                if not count:  # e.g. per_expert's fused dispatch where the op ran its two kernels
                    continue
                print(f"[low_latency T={tokens}{tag}] {label}: {us:.1f} us (median of {count} launches over all "
                      f"GPUs)")
                rows.append(dict(mode="low_latency", tokens=tokens, name=label + tag, kind="phase", op="phase",
                                 us=us, gbps=0.0, launches=count))
    return rows


def _speedup(r, base, key="us"):
    """base time / r's time (key "us": wall per call; "marginal_us": per added call); with several rounds the median
    of the per-round ratios and their min-max."""
    reps, base_reps = r.get(key[:-2] + "reps_us") or [], base.get(key[:-2] + "reps_us") or []
    if len(reps) > 1 and len(reps) == len(base_reps):
        ratios = sorted(b / x for b, x in zip(base_reps, reps))
        return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
    return f"{base[key] / r[key]:.2f}x"


def print_table(results):
    """The results as one markdown table; with --marginal two more columns: per added call, and its ratio."""
    marginal = any(r.get("marginal_us") for r in results)
    extra = " per added call (us) | x best JAX baseline per added call |" if marginal else ""
    print("\n| mode | T | contender | op | time (us) | GB/s | x best JAX baseline | first call / steady |" + extra)
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if marginal else ""))
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | {r['tokens']} | {r['name']} | | failed | | | |" + (" | |" if marginal else ""))
            continue
        base = [b for b in results if b.get("kind") == "baseline" and "error" not in b
                and b["mode"] == r["mode"] and b["tokens"] == r["tokens"] and b["op"] == r["op"]]
        speedup = _speedup(r, min(base, key=lambda b: b["us"])) if base and r["kind"] == "jax_ep" else ""
        ratio = (f"{r['first_call_us'] / r['single_call_us']:.2f}" if r.get("first_call_us") and
                 r.get("single_call_us") else "")
        gbps = f"{r['gbps']:.1f}" if r.get("gbps") else ""
        line = (f"| {r['mode']} | {r['tokens']} | {r['name']} | {r['op']} | {r['us']:.1f} | {gbps} | "
                f"{speedup} | {ratio} |")
        if marginal:
            m = r.get("marginal_us")
            mbase = [b for b in base if b.get("marginal_us")]
            mspeed = (_speedup(r, min(mbase, key=lambda b: b["marginal_us"]), "marginal_us")
                      if m and mbase and r["kind"] == "jax_ep" else "")
            line += f" {m:.1f} | {mspeed} |" if m else " | |"
        print(line)


def write_outputs(results, args, machine, model):
    os.makedirs(args.out, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=machine, jax=jax.__version__, process_model=model,
                command="python -m jax_ep.bench " + " ".join(sys.argv[1:]))
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"\nwrote {path}")
    try:
        from .plot import plot_results
        for png in plot_results(results, args.out, machine):
            print(f"wrote {png}")
    except ImportError as e:
        print(f"no plot: {e} (pip install matplotlib)")


if __name__ == "__main__":
    sys.exit(main())
