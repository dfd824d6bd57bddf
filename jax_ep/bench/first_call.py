"""What jax_ep.initialize and jax_ep.warmup buy: `jax_ep.initialize` step times, and the first call of a compiled
dispatch + combine program against its steady state, next to the same exchange as a padded all_to_all program.

    python -m jax_ep.bench.first_call --mode eager                       # one process driving all local GPUs
    python -m jax_ep.bench.first_call --mode lazy
    python -m jax_ep.bench.first_call --mode all_to_all                  # the padded all_to_all program, no jax_ep
    python -m jax_ep.bench.first_call --mode xla                         # control: plain XLA program, no collective
    python -m jax_ep.bench.first_call --op low_latency --tokens 1 --mode eager --warmup-calls 2
    python -m jax_ep.launch -n 4 -m jax_ep.bench.first_call --mode eager  # one process per GPU (NVSHMEM)

Run each mode in a fresh process (NVSHMEM, once up, stays up in a process). The program is one jit(shard_map) over
all GPUs, of the op chosen by --op (the shapes and configs of `python -m jax_ep.bench`):
  normal        jax_ep.dispatch (bf16) + jax_ep.combine; T=4096 H=7168 K=8 E=256 by default
  low_latency   jax_ep.low_latency_dispatch (fp8) + jax_ep.low_latency_combine with the dispatch's handle, in
                EPConfig.low_latency_mode --ll-mode; T=128 H=7168 K=8 E=288 by default. The combine's bf16 expert
                output [E/R, R*T, H] per GPU is a program input (as the bench's LL combine case has it), so no
                conversion of the fp8 rows is timed.
and of the way chosen by --mode:
  eager         jax_ep.initialize before tracing (--no-warmup-ops: initialize(..., warmup_ops=False))
  lazy          the runtime starts with a config of another token count on the same mesh, and the program's config
                is added to it while the program is traced (jax_ep never guesses devices: with no runtime at all a
                traced op asks for jax_ep.initialize)
  all_to_all    the padded lax.all_to_all dispatch (bf16 rows) + combine of the same routing ("all_to_all
                padded" in `python -m jax_ep.bench`); no jax_ep runtime
  xla           control: a plain XLA program of the same inputs and output shape, no collective, no jax_ep runtime
With --warmup-calls N (N >= 1), jax_ep.warmup(compiled, *args, calls=N) runs the compiled program N times after
compiling, and the timed calls start after it: the first call is then the first serving call. Without a CUDA GPU
(and, for eager and lazy, without the built extension) nothing is measured: it says so and exits with status 2.

Reported (process 0; with several processes every timed step starts after a cross-process barrier, and the max over
processes is shown):
  initialize   wall time of jax_ep.initialize and its steps (Runtime.timings)   [eager]
  lower        tracing + lowering (includes the trace-time initialize in lazy mode)
  compile      XLA compilation
  warmup       wall time of the --warmup-calls executions (JSON only, when N >= 1)
  first call   wall time of the first timed execution of the compiled program (compile excluded)
  second call  the execution after it (without warm-up calls, XLA records its CUDA graph there when command
               buffers are on)
  steady       median wall time of the --calls executions after those two
Prints one JSON line (`PREWARM {...}`: times in seconds (*_s) or ms (*_ms), with op, T, H, K, E, ll_mode and nvl
for low_latency, warmup_calls, process_model, transport, and per_process_us: each process's first, second and
steady time, since a process that starts a collective early waits for the others and the fastest process shows the
op without that skew; steady_range_us: the fastest and slowest steady call of process 0, the spread a single first
call is read against)
and one Markdown table row:
  | op | T | process model | mode | initialize ms | initialize steps ms | lower ms | compile ms | first call us |
  second call us | steady us | first / steady | env |
where env holds CUDA_MODULE_LOADING and XLA_FLAGS when set, warmup_ops (eager) and warmup_calls.
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

# (tokens per rank, experts) when not given: the GPU defaults of `python -m jax_ep.bench` (--tokens / --experts for
# normal mode, --ll-tokens / --ll-experts for low latency)
DEFAULT_SHAPE = {"normal": (4096, 256), "low_latency": (128, 288)}
JAX_EP_MODES = ("eager", "lazy")


def _int_at_least(least):
    """An argparse type: an int >= least (argparse names the option in its error)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return parse


def parse_args(argv):
    """The namespace with tokens and experts resolved for --op, and `cfg`, the op's EPConfig (backend cuda)."""
    ap = argparse.ArgumentParser(
        prog="python -m jax_ep.bench.first_call",
        description="What jax_ep.initialize and jax_ep.warmup buy: jax_ep.initialize step times and first-call vs "
                    "steady-state latency of a compiled dispatch + combine program, next to a padded all_to_all "
                    "program of the same exchange. CUDA only (needs GPUs, and the built extension for the jax_ep "
                    "modes); on CPU it says so and exits with status 2.")
    ap.add_argument("--op", choices=["normal", "low_latency"], default="normal",
                    help="normal: dispatch (bf16) + combine; low_latency: low_latency_dispatch (fp8) + "
                         "low_latency_combine (default: normal)")
    ap.add_argument("--mode", choices=["eager", "lazy", "all_to_all", "xla"], required=True,
                    help="eager: jax_ep.initialize before tracing; lazy: the program's config is added to a runtime "
                         "at trace time; all_to_all: the padded lax.all_to_all program of the same op, no jax_ep; "
                         "xla: a plain XLA program of the same inputs and output shape, no collective (control)")
    ap.add_argument("--ll-mode", choices=["per_expert", "per_rank"], default="per_expert",
                    help="EPConfig.low_latency_mode of --op low_latency (default: per_expert)")
    ap.add_argument("--tokens", type=_int_at_least(1), default=None,
                    help="T, tokens per rank (default: 4096 for normal, 128 for low_latency)")
    ap.add_argument("--hidden", type=_int_at_least(1), default=7168, help="H (default: 7168)")
    ap.add_argument("--topk", type=_int_at_least(1), default=8, help="K, experts per token (default: 8)")
    ap.add_argument("--experts", type=_int_at_least(1), default=None,
                    help="E (default: 256 for normal, 288 for low_latency)")
    ap.add_argument("--calls", type=_int_at_least(1), default=20,
                    help="executions for the steady-state median (default: 20)")
    ap.add_argument("--warmup-calls", type=_int_at_least(0), default=0, metavar="N",
                    help="jax_ep.warmup(compiled, *args, calls=N) before the timed calls (default: 0, none)")
    ap.add_argument("--num-sms", type=_int_at_least(1), default=24, help="EPConfig.num_sms (default: 24)")
    ap.add_argument("--nvl", type=_int_at_least(1), default=8,
                    help="EPConfig.num_max_nvl_peers, as `python -m jax_ep.bench --nvl` (default: 8)")
    ap.add_argument("--no-warmup-ops", action="store_true",
                    help="eager mode: jax_ep.initialize(..., warmup_ops=False), no warm-up execution of the ops")
    a = ap.parse_args(argv)
    default_tokens, default_experts = DEFAULT_SHAPE[a.op]
    a.tokens = default_tokens if a.tokens is None else a.tokens
    a.experts = default_experts if a.experts is None else a.experts
    a.cfg = _config(ap, a)
    return a


def _config(ap, a):
    """The op's EPConfig (bench_config of the main bench, CUDA backend); argparse errors name the options."""
    from jax_ep.config import FP8_BLOCK, LOW_LATENCY_AUTO_MAX_TOKENS, MAX_TOPK
    from jax_ep.errors import EPError

    from .contenders import bench_config

    if a.topk > min(a.experts, MAX_TOPK):
        ap.error(f"--topk ({a.topk}) must be at most --experts ({a.experts}) and {MAX_TOPK} (the kernels' limit)")
    if a.op == "low_latency" and a.hidden % FP8_BLOCK:
        ap.error(f"--hidden ({a.hidden}) must be a multiple of {FP8_BLOCK} for --op low_latency (fp8 dispatch)")
    if a.op == "low_latency" and a.tokens > LOW_LATENCY_AUTO_MAX_TOKENS:
        ap.error(f"--tokens ({a.tokens}) must be at most {LOW_LATENCY_AUTO_MAX_TOKENS} for --op low_latency (the "
                 f"low-latency buffers exist up to that many tokens per rank)")
    ll_mode = a.ll_mode if a.op == "low_latency" else "per_expert"  # --ll-mode only concerns the LL program
    try:
        return bench_config(a.tokens, a.hidden, a.topk, a.experts, "cuda", a.num_sms, ll_mode, a.nvl)
    except EPError as e:
        ap.error(f"--tokens/--hidden/--topk/--experts/--num-sms/--nvl: {e}")


def _random_bf16(shape, sharding, seed):
    """bf16 N(0,1) data of a global shape, made on the devices of `sharding` (in every process model)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16), out_shardings=sharding)(jax.random.key(seed))


def make_args(op, cfg, mesh):
    """The program's inputs, sharded over the mesh: x [R*T, H] bf16, topk_idx [R*T, K] i32 (DeepEP's routing),
    topk_weights [R*T, K] f32, and for low_latency the combine's expert output [R*L, R*T, H] bf16 (L = E/R)."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from .contenders import AXIS, deepep_routing
    from .harness import to_global

    R, T = mesh.devices.size, cfg.max_tokens_per_rank
    rng = np.random.default_rng(0)
    idx = deepep_routing(rng, R, T, cfg.num_experts, cfg.num_topk)
    w = rng.random(size=idx.shape).astype(np.float32)
    sharding = NamedSharding(mesh, P(AXIS))
    args = (_random_bf16((R * T, cfg.hidden), sharding, 1), to_global(idx, mesh, P(AXIS)),
            to_global(w, mesh, P(AXIS)))
    if op == "low_latency":
        expert_out = (R * cfg.num_local_experts(R), cfg.low_latency_rows(R), cfg.hidden)
        args += (_random_bf16(expert_out, sharding, 2),)
    return args


def program_body(op, mode, cfg, num_ranks):
    """The per-shard function of (op, mode), taking make_args' inputs and returning y [T, H] bf16."""
    import jax.numpy as jnp

    import jax_ep

    from . import baselines
    from .contenders import AXIS

    def xla_control(x, idx, w, *_):
        return (x.astype(jnp.float32) * w[:, :1]).astype(x.dtype) + idx[:, :1].astype(x.dtype)

    def padded_all_to_all(x, idx, *_):
        recv = baselines.padded_all_to_all_dispatch(x, idx, cfg.num_experts, num_ranks, AXIS)
        return baselines.padded_all_to_all_combine(recv, AXIS)

    def normal(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, cfg)
        return jax_ep.combine(out.recv_x, out.handle, cfg)[0]

    def low_latency(x, idx, w, expert_out):
        handle = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=True).handle
        return jax_ep.low_latency_combine(expert_out, idx, w, handle, cfg)

    if mode == "xla":
        return xla_control
    if mode == "all_to_all":
        return padded_all_to_all
    return normal if op == "normal" else low_latency


def build_program(op, mode, cfg, mesh):
    """(jit(shard_map(body)), args): the program of (op, mode) and its inputs."""
    import jax
    from jax.sharding import PartitionSpec as P

    from .contenders import AXIS

    args = make_args(op, cfg, mesh)
    body = program_body(op, mode, cfg, mesh.devices.size)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) * len(args), out_specs=P(AXIS))), args


def lazy_base_config(cfg):
    """The config lazy mode's runtime starts with: the program's, for another token count."""
    import dataclasses

    return dataclasses.replace(cfg, max_tokens_per_rank=16 if cfg.max_tokens_per_rank != 16 else 8)


def _unavailable(mode):
    """Why this process cannot measure `mode` (None when it can)."""
    import jax

    from jax_ep import _native

    if not [d for d in jax.devices() if d.platform == "gpu"]:
        return "no CUDA GPU"
    if mode in JAX_EP_MODES and not _native.available():
        return f"the native extension is unavailable ({_native.load_error()})"
    return None


def main(argv=None):
    a = parse_args(argv)

    from jax_ep.launch import init_from_env

    pid, nproc = init_from_env()
    why = _unavailable(a.mode)
    if why:
        print(f"python -m jax_ep.bench.first_call: CUDA only: {why}; nothing measured", file=sys.stderr)
        return 2

    import numpy as np
    import jax
    from jax.experimental import multihost_utils

    import jax_ep

    from .contenders import bench_mesh

    def sync(name):
        if nproc > 1:
            multihost_utils.sync_global_devices(f"jax_ep_first_call_{name}")

    def each_process(seconds):
        if nproc == 1:
            return [seconds]
        return [float(v) for v in np.ravel(multihost_utils.process_allgather(np.float64(seconds)))]

    def slowest(seconds):
        return max(each_process(seconds))

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    R, cfg = len(devices), a.cfg
    if cfg.num_experts % R:
        print(f"python -m jax_ep.bench.first_call: --experts ({cfg.num_experts}) must be divisible by the number of "
              f"GPUs ({R})", file=sys.stderr)
        return 2
    mesh = bench_mesh(devices)
    prog, args = build_program(a.op, a.mode, cfg, mesh)
    row = {"op": a.op, "mode": a.mode, "processes": nproc, "gpus": R, "T": cfg.max_tokens_per_rank, "H": cfg.hidden,
           "K": cfg.num_topk, "E": cfg.num_experts, "device": devices[0].device_kind, "warmup_calls": a.warmup_calls}
    if a.op == "low_latency":
        row.update(ll_mode=cfg.low_latency_mode, nvl=cfg.num_max_nvl_peers)

    sync("start")
    if a.mode == "lazy":
        jax_ep.initialize(mesh, lazy_base_config(cfg), warmup_ops=False)
        sync("lazy_runtime")
    if a.mode == "eager":
        t = time.perf_counter()
        rt = jax_ep.initialize(mesh, cfg, warmup_ops=not a.no_warmup_ops)
        row["initialize_s"] = slowest(time.perf_counter() - t)
        row["initialize_steps_ms"] = _steps_ms(rt)
        sync("initialized")
    t = time.perf_counter()
    lowered = prog.lower(*args)
    row["lower_s"] = slowest(time.perf_counter() - t)
    row.update(_runtime_fields(a.mode, jax_ep.runtime.current(), nproc))
    t = time.perf_counter()
    compiled = lowered.compile()
    row["compile_s"] = slowest(time.perf_counter() - t)
    if a.warmup_calls:
        sync("warmup")
        t = time.perf_counter()
        jax_ep.warmup(compiled, *args, calls=a.warmup_calls)
        row["warmup_s"] = slowest(time.perf_counter() - t)
    times = []
    for i in range(a.calls + 2):
        sync(f"call{i}")
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    timed = {"first": times[0], "second": times[1], "steady": statistics.median(times[2:])}
    per_process = {name: each_process(seconds) for name, seconds in timed.items()}
    row["first_call_s"], row["second_call_s"], row["steady_s"] = (max(per_process[n]) for n in timed)
    row["per_process_us"] = {n: [round(v * 1e6, 1) for v in vs] for n, vs in per_process.items()}
    steady = sorted(times[2:])
    row["steady_range_us"] = [round(steady[0] * 1e6, 1), round(steady[-1] * 1e6, 1)]  # this process's
    row["first_over_steady"] = row["first_call_s"] / row["steady_s"]
    row["env"] = {k: os.environ[k] for k in ("CUDA_MODULE_LOADING", "XLA_FLAGS") if os.environ.get(k)}
    if a.mode == "eager":
        row["env"]["warmup_ops"] = not a.no_warmup_ops
    row["env"]["warmup_calls"] = a.warmup_calls
    if pid == 0:
        print(f"PREWARM {json.dumps(row)}", flush=True)
        print(markdown_row(row), flush=True)
    jax_ep.finalize()
    return 0


def _steps_ms(rt):
    return {k: round(v * 1e3, 2) for k, v in rt.timings.items()}


def _runtime_fields(mode, rt, nproc):
    """process_model, transport and (for the jax_ep modes) initialize_steps_ms of the row, read after lowering."""
    if rt is None:  # all_to_all and xla: no jax_ep runtime
        transport = "none (XLA all_to_all)" if mode == "all_to_all" else "none (plain XLA)"
        return {"process_model": "multi-process" if nproc > 1 else "single-process", "transport": transport,
                "initialize_steps_ms": {}}
    fields = {"process_model": rt.process_model, "transport": rt.transport}
    if mode == "lazy":
        fields["initialize_steps_ms"] = _steps_ms(rt)
    return fields


def markdown_row(row):
    """The row's Markdown line (columns in the module docstring)."""
    op = row["op"] if row.get("ll_mode", "per_expert") == "per_expert" else f"{row['op']} ({row['ll_mode']})"
    init = f"{row['initialize_s'] * 1e3:.1f}" if "initialize_s" in row else "-"
    cells = [op, row["T"], row["process_model"], row["mode"], init, json.dumps(row["initialize_steps_ms"]),
             f"{row['lower_s'] * 1e3:.1f}", f"{row['compile_s'] * 1e3:.1f}", f"{row['first_call_s'] * 1e6:.0f}",
             f"{row['second_call_s'] * 1e6:.0f}", f"{row['steady_s'] * 1e6:.0f}", f"{row['first_over_steady']:.2f}",
             json.dumps(row["env"])]
    return "| " + " | ".join(str(c) for c in cells) + " |"


if __name__ == "__main__":
    sys.exit(main())
