"""Timing method of docs/BENCHMARKS.md ("Method"): a jitted loop of N back-to-back calls, median of several loops.

Each loop carries the op's input and writes one row of the op's output back into it (an in-place
dynamic-update-slice), so every call depends on the previous one: nothing is loop-invariant, nothing is dead.
The loop is unrolled: on XLA:GPU every iteration of a rolled while loop copies its predicate to the host (a ~50 us
round trip per iteration here), which would be charged to each call; unrolled, the N calls run back to back.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding


def chained_loop(op: Callable, num_calls: int, mesh, in_specs, feedback: Callable, unroll: bool = True):
    """jit(shard_map(loop)) running `op(*args)` num_calls times; feedback(args, out) -> args of the next call."""

    def body(*args):
        def step(_, carry):
            return feedback(carry, op(*carry))
        return jax.lax.fori_loop(0, num_calls, step, tuple(args), unroll=unroll)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=in_specs))


def feed_row(carry, out):
    """Write the first row of `out` into the first row of carry[0] (cast, truncated or zero-padded to fit)."""
    x = carry[0]
    width = x.shape[-1]
    row = out.reshape(-1, out.shape[-1])[0, :width].astype(x.dtype)
    row = jnp.pad(row, (0, width - row.shape[0])).reshape((1,) * (x.ndim - 1) + (width,))
    return (jax.lax.dynamic_update_slice(x, row, (0,) * x.ndim),) + tuple(carry[1:])


def to_global(a, mesh, spec):
    """`a` as an array sharded over the whole mesh by `spec`, in both process models: an array that already spans
    processes is only resharded; anything else (numpy, or an array on this process's devices, the same value on
    every process) goes through the host to every process's shards. A pytree (e.g. a handle) is converted leaf by
    leaf with the same spec."""
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(a)):
        return jax.tree_util.tree_map(lambda leaf: to_global(leaf, mesh, spec), a)
    sharding = NamedSharding(mesh, spec)
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return jax.device_put(a, sharding)
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@dataclasses.dataclass
class Prepared:
    """A compiled chained loop of one op with its inputs, ready to be timed (measure), and its first-call figures."""
    name: str
    loop: Callable
    args: tuple
    num_calls: int
    first_call: float | None
    single_call: float | None
    loop_spread: float | None = None  # (max - min) / median of the last measured loops
    loops_us: list = dataclasses.field(default_factory=list)  # us per call of every measured loop, in order
    # marginal: the same loop with 2N calls, timed right after each N-call loop; (t(2N) - t(N)) / N is the time an
    # added call costs, without the loop's launch and wait
    loop2: Callable | None = None
    marginal: list = dataclasses.field(default_factory=list)  # seconds per added call of the last measure()


def prepare_op(name, op, args, mesh, in_specs, feedback=feed_row, num_calls=20, loops=5, first_call=True,
               unroll=True, marginal=False) -> Prepared:
    """Compiles the chained loop and runs it once (warm-up); with first_call, first times a one-call program's first
    execution and the median of `loops` later ones; with marginal, also a loop of 2 * num_calls (Prepared.loop2)."""
    args = tuple(to_global(a, mesh, s) for a, s in zip(args, in_specs))
    first = steady_single = None
    if first_call:  # one call, compiled ahead: the first execution's latency (compile excluded)
        single = chained_loop(op, 1, mesh, in_specs, feedback).lower(*args).compile()
        t0 = time.perf_counter()
        jax.block_until_ready(single(*args))
        first = time.perf_counter() - t0
        single_times = []
        for _ in range(loops):
            t0 = time.perf_counter()
            jax.block_until_ready(single(*args))
            single_times.append(time.perf_counter() - t0)
        steady_single = statistics.median(single_times)
    loop = chained_loop(op, num_calls, mesh, in_specs, feedback, unroll).lower(*args).compile()
    jax.block_until_ready(loop(*args))  # warm-up
    loop2 = None
    if marginal:
        loop2 = chained_loop(op, 2 * num_calls, mesh, in_specs, feedback, unroll).lower(*args).compile()
        jax.block_until_ready(loop2(*args))
    return Prepared(name, loop, args, num_calls, first, steady_single, loop2=loop2)


def measure(prep: Prepared, loops: int) -> list[float]:
    """Seconds per call of each of `loops` runs of the prepared loop. With prep.loop2, each run is followed by one of
    the 2N-call loop, and prep.marginal gets (t(2N) - t(N)) / N of each pair."""
    samples = []
    prep.marginal = []
    for _ in range(loops):
        t0 = time.perf_counter()
        jax.block_until_ready(prep.loop(*prep.args))
        t1 = time.perf_counter()
        samples.append((t1 - t0) / prep.num_calls)
        if prep.loop2 is not None:
            jax.block_until_ready(prep.loop2(*prep.args))
            prep.marginal.append((time.perf_counter() - t1 - (t1 - t0)) / prep.num_calls)
    return samples

