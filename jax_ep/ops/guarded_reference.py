"""The reference backend with an arrival check before every op, for jobs of several processes (API layer).

Each backend function call becomes: one host callback per device (runtime/arrival.py: meet the other processes on
the key-value store, bounded by cfg.timeout_seconds, or raise an EPError naming the op and the missing process),
tied to the op's array inputs by an optimization barrier so the op's collectives cannot start before it. In a
single process nothing changes (backend_for returns the plain module).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

from ..backends import reference
from ..config import EPConfig
from ..runtime import arrival


def _is_array(leaf) -> bool:
    return isinstance(leaf, jax.Array)  # tracers included


def _arrival_token(op: str, cfg: EPConfig, num_ranks: int) -> jax.Array:
    mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names) or (cfg.axis_name,)
    device_index = lax.axis_index(mesh_axes)  # unique per device of the mesh: keys its own op count
    rank = lax.axis_index(cfg.axis_name)

    def host(d, r):
        arrival.arrive(op, cfg.axis_name, cfg.timeout_seconds, int(d), int(r), num_ranks)
        return np.int32(0)

    return io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), device_index, rank)


class GuardedReference:
    """Proxy of backends.reference for one op: every function waits for the arrival first (see module docstring)."""

    def __init__(self, op: str, cfg: EPConfig):
        self.op, self.cfg = op, cfg

    def __getattr__(self, name):
        fn = getattr(reference, name)
        if not callable(fn):
            return fn

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            num_ranks = jax.sharding.get_abstract_mesh().shape[self.cfg.axis_name]
            leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
            arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
            token = _arrival_token(self.op if name == self.op else f"{self.op} ({name})", self.cfg, num_ranks)
            tied, _ = lax.optimization_barrier(([leaves[i] for i in arrays], token))
            for i, value in zip(arrays, tied):
                leaves[i] = value
            a, kw = jax.tree_util.tree_unflatten(tree, leaves)
            return fn(*a, **kw)

        return guarded
