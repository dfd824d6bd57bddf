"""Per-kernel device times from the JAX profiler (CUPTI), like DeepEP's kernel-time figures.

Used for the low-latency send / receive phases: both halves always run together (a send without its receive
would block the send two ops later), so their separate times come from the kernels' own durations in a trace.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import statistics
import tempfile


def trace_events(fn, args, iterations: int = 20) -> list:
    """Runs fn(*args) once untraced (compiled and warm), then `iterations` times under the profiler; returns the
    perfetto trace's events. Raises RuntimeError when the profiler produced no trace (e.g. no CUPTI)."""
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        try:
            out = None
            for _ in range(iterations):
                out = fn(*args)
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(folder, "**", "*perfetto_trace.json.gz"), recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no perfetto trace under {folder}")
        with gzip.open(files[0], "rt") as f:
            return json.load(f).get("traceEvents", [])


def kernel_times(fn, args, patterns: dict, iterations: int = 20) -> dict:
    """Runs fn(*args) `iterations` times under the profiler; for each label -> substring in `patterns`, returns
    (launches seen, median duration in us) of the kernels whose name contains the substring. Raises RuntimeError
    when the profiler produced no trace (e.g. no CUPTI)."""
    events = trace_events(fn, args, iterations)
    found = {label: [] for label in patterns}
    for ev in events:
        name, dur = ev.get("name", ""), ev.get("dur")
        if dur is None:
            continue
        for label, needle in patterns.items():
            if needle in name:
                found[label].append(float(dur))
    return {label: (len(v), statistics.median(v) if v else float("nan")) for label, v in found.items()}
