"""Timing of the intranode CUDA backend vs the reference backend, same harness, same run (method of docs/BENCHMARKS.md):
a jitted fori_loop of N back-to-back calls, wall time / N after warm-up, median of REPS loops; bandwidth = bytes of
rows rank 0 receives (local rows included; fp8: 1 byte/element + 4 bytes per 128-element scale) / time.

usage: python tests/gpu/bench_intranode.py [R] [T] [H] [K] [E]   (defaults 4 4096 7168 8 256); prints JSON lines.
"""

import json
import sys
import time

import numpy as np

import intranode_harness as h

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ep.backends import reference
from intranode_harness import cuda_backend
from jax_ep.config import EPConfig

N, REPS = 20, 5


def timed(fn, *args):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) / N)
    return float(np.median(ts)), ts


def main():
    R, T, H, K, E = (int(a) for a in (sys.argv[1:] + ["4", "4096", "7168", "8", "256"][len(sys.argv) - 1:])[:5])
    reason = h.skip_reason(R)
    if reason:
        print(json.dumps({"skipped": reason}))
        return
    cfg = EPConfig(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, axis_name="ep", backend="cuda")
    group = h.Group(R, [cfg])
    rng = np.random.default_rng(0)
    xb, _, idx, w = h.inputs(rng, R, T, H, K, E, "deepep")
    x8, s8, _, _ = h.inputs(rng, R, T, H, K, E, "deepep", fp8=True)
    xb, idx, w, x8, s8 = (group.shard(a) for a in (xb, idx, w, x8, s8))

    def loop_dispatch(be, fp8):
        def body(x, s, idx, w):
            def it(i, x):
                out = be.dispatch(x, s if fp8 else None, idx, w, cfg, R)
                return lax.dynamic_update_slice(x, out.recv_x[:1], (0, 0))  # loop-carried: nothing hoisted
            x = lax.fori_loop(0, N, it, x)
            return x[:1]
        return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"),) * 4, out_specs=P("ep")))

    def loop_combine(be):
        def body(x, idx, w):
            out = be.dispatch(x, None, idx, w, cfg, R)
            def it(i, v):
                y, _ = be.combine(v, None, out.handle, cfg, R)
                return lax.dynamic_update_slice(v, y[:1], (0, 0))
            v = lax.fori_loop(0, N, it, out.recv_x)
            return v[:1], out.num_recv_tokens[None]
        return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))

    n_recv = None
    results = []
    for name, be in (("cuda", cuda_backend), ("reference", reference)):
        for op in ("dispatch_bf16", "dispatch_fp8", "combine_bf16"):
            try:
                if op == "combine_bf16":
                    f = loop_combine(be)
                    _, nr = f(xb, idx, w)
                    n_recv = int(np.asarray(nr).ravel()[0])
                    t, ts = timed(f, xb, idx, w)
                else:
                    fp8 = op.endswith("fp8")
                    t, ts = timed(loop_dispatch(be, fp8), x8 if fp8 else xb, s8, idx, w)
                results.append((name, op, t, ts))
            except Exception as e:  # keep timing the others
                print(json.dumps({"backend": name, "op": op, "error": str(e)[:500]}), flush=True)
    for name, op, t, ts in results:
        row_bytes = H + (H // 128) * 4 if op.endswith("fp8") else 2 * H
        gbps = n_recv * row_bytes / t / 1e9 if n_recv else None
        print(json.dumps({"backend": name, "op": op, "R": R, "T": T, "H": H, "K": K, "E": E, "rows_rank0": n_recv,
                          "us": round(t * 1e6, 1), "GB/s": None if gbps is None else round(gbps, 1),
                          "loops_us": [round(v * 1e6, 1) for v in ts], "process_model": "single-process",
                          "gpu": jax.devices()[0].device_kind}), flush=True)
    group.close()


if __name__ == "__main__":
    main()
