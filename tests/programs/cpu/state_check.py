"""Child program for tests/test_user_path.py: jax_ep.check_low_latency_state on the global state array of a job of
several processes (each process holds only its own ranks' shards).

    python -m jax_ep.launch -n 2 tests/programs/cpu/state_check.py --case {ok,misordered}

ok: a well-ordered chain; the check passes on every process. misordered: a third split send while two are in flight
on every rank; the check raises jax_ep.EPError naming every rank of this process. Prints `RESULT <case> ...`.
"""
import argparse

from _child import global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--case", choices=["ok", "misordered"], required=True)
a = ap.parse_args()
pid, nproc = join_job("cpu", 2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

devices = global_devices()
R = len(devices)
mesh = Mesh(np.array(devices), ("ep",))
cfg = jax_ep.EPConfig(num_experts=2 * R, hidden=128, num_topk=2, max_tokens_per_rank=4, backend="reference")


def body(x, idx):
    state = jax_ep.low_latency_state(cfg)
    sends = 3 if a.case == "misordered" else 1
    for _ in range(sends):
        _, state = jax_ep.low_latency_dispatch_send(x, idx, cfg, use_fp8=False, state=state)
    return state.value


x = jax.make_array_from_callback((R * 4, 128), jax.sharding.NamedSharding(mesh, P("ep")),
                                 lambda i: np.ones((4, 128), jax.numpy.bfloat16))
idx = jax.make_array_from_callback((R * 4, 2), jax.sharding.NamedSharding(mesh, P("ep")),
                                   lambda i: np.zeros((4, 2), np.int32))
value = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep")))(x, idx)
assert not value.is_fully_addressable
try:
    jax_ep.check_low_latency_state(value)
    print(f"RESULT {a.case} process={pid} raised=none", flush=True)
except jax_ep.EPError as e:
    print(f"RESULT {a.case} process={pid} raised=EPError message={str(e)!r}", flush=True)
