"""Child program for tests/test_launch.py: one rank fails, the others block in a cross-process collective.

    python -m jax_ep.launch -n N --no-gpu-pinning tests/programs/cpu/fail_rank.py --fail-rank R [--how HOW]

Every rank joins the job (init_from_env) and prints `PID <pid>` so the test can check nobody is left behind.
Rank R then fails with exit code 3 (--how exit: sys.exit(3) after a Python exception-free path; raise: an
uncaught exception, so the exit code is 1; os_exit: os._exit(3), like a crash; signal: SIGKILL itself) while
every other rank enters a psum that cannot complete without rank R and would hang (then sleeps, to be sure).
"""
import argparse
import os
import signal
import sys
import time

from _child import global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--fail-rank", type=int, default=1)
ap.add_argument("--how", choices=["exit", "raise", "os_exit", "signal"], default="exit")
ap.add_argument("--no-collective", action="store_true", help="others just sleep instead of entering a psum")
a = ap.parse_args()
pid, n = join_job("cpu", 1)

import jax  # noqa: E402
print(f"PID {os.getpid()}", flush=True)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

devices = global_devices()
mesh = Mesh(np.array(devices), ("x",))
sh = NamedSharding(mesh, P("x"))
arr = jax.make_array_from_process_local_data(sh, np.ones((1, 4), np.float32), (len(devices), 4))
psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
psum(arr).block_until_ready()  # everyone is up and connected
print("warm-up psum done", flush=True)

if pid == a.fail_rank:
    time.sleep(0.5)
    print(f"rank {pid} failing now ({a.how})", flush=True)
    if a.how == "exit":
        sys.exit(3)
    if a.how == "raise":
        raise RuntimeError(f"deliberate failure on rank {pid}")
    if a.how == "os_exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
if not a.no_collective:
    print("entering psum that cannot complete", flush=True)
    psum(arr * 2).block_until_ready()
    print("psum returned (no rank failed)", flush=True)
time.sleep(600)
