"""Child program for tests/test_user_path.py: rank R raises right after joining, before its first collective, while
the others enter a psum that can never complete.

    python -m jax_ep.launch -n N tests/programs/cpu/raise_early.py --fail-rank R
"""
import argparse
import os

from _child import global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--fail-rank", type=int, default=0)
a = ap.parse_args()
pid, n = join_job("cpu", 1)
print(f"PID {os.getpid()}", flush=True)
if pid == a.fail_rank:
    raise RuntimeError(f"rank {pid} failed before its first collective")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(global_devices()), ("x",))
arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones((1, 4), np.float32), (n, 4))
jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))(arr).block_until_ready()
print("psum returned (no rank failed)", flush=True)
