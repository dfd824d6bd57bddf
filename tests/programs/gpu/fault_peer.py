"""GPU child program for tests/gpu/test_faults_cuda.py: a loop of low-latency and normal-mode ops in which one rank
goes missing.

    python -m jax_ep.launch -n N fault_peer.py --victim V --how {kill,stop} --after S --timeout T
    JAX_EP_TEST_ABSENT_RANK=V:n python fault_peer.py --how absent --timeout T     (one process driving every GPU)

Every step runs a low-latency dispatch + combine and a normal-mode dispatch + combine (one jitted program) and
prints `STEP i`. kill / stop: after step S the victim's process sends itself SIGKILL / SIGSTOP; the other ranks' next
ops wait for it on the device until cfg.timeout_seconds = T, then trap. absent: the handlers of rank V launch
nothing once the hook's count is reached (xla_ffi/test_hooks.h). Prints `RESULT ...` lines; the test reads what the
processes and the launcher print and how long they took.
"""
import argparse
import os
import signal
import time

from _child import prepare, reporter

prepare()
ap = argparse.ArgumentParser()
ap.add_argument("--how", choices=["kill", "stop", "absent"], required=True)
ap.add_argument("--victim", type=int, default=1)
ap.add_argument("--after", type=int, default=3)
ap.add_argument("--steps", type=int, default=1000)
ap.add_argument("--timeout", type=float, default=10.0)
a = ap.parse_args()

from jax_ep.launch import init_from_env  # noqa: E402

pid, nproc = init_from_env()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

result = reporter(pid)
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
R, T, H, K = len(devices), 32, 512, 4
E = 4 * R
mesh = Mesh(np.array(devices), ("ep",))
normal = jax_ep.EPConfig(E, H, K, T, backend="cuda", timeout_seconds=a.timeout)
ll = jax_ep.EPConfig(E, H, K, T, backend="cuda", timeout_seconds=a.timeout, low_latency_buffers=True)
jax_ep.initialize(mesh, normal, ll)


def body(x, idx, w):
    lo = jax_ep.low_latency_dispatch(x, idx, ll, use_fp8=False)
    y_ll = jax_ep.low_latency_combine(lo.recv_x, idx, w, lo.handle, ll)
    out = jax_ep.dispatch(x, idx, w, normal)
    y, _ = jax_ep.combine(out.recv_x, out.handle, normal)
    return (y.astype(jnp.float32) + y_ll.astype(jnp.float32)).sum(keepdims=True)


sharding = jax.sharding.NamedSharding(mesh, P("ep"))
step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
rng = np.random.default_rng(0)
idx_all = np.stack([rng.permutation(E)[:K] for _ in range(R * T)]).astype(np.int32)
mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]


def global_array(value):
    rows = value.reshape(R, T, *value.shape[1:])[mine].reshape(-1, *value.shape[1:])
    return jax.make_array_from_process_local_data(sharding, rows, value.shape)


x = global_array(np.ones((R * T, H), jnp.bfloat16))
idx = global_array(idx_all)
w = global_array(np.full((R * T, K), 0.25, np.float32))
my_ranks = [i for i in mine]
result("start", ranks=my_ranks, victim=a.victim, how=a.how, timeout=a.timeout)
t_fault = None
try:
    for i in range(a.steps):
        jax.block_until_ready(step(x, idx, w))
        print(f"STEP {i} process={pid} t={time.time():.3f}", flush=True)
        if a.how in ("kill", "stop") and i == a.after and a.victim in my_ranks:
            result("fault", how=a.how, t=f"{time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL if a.how == "kill" else signal.SIGSTOP)
except Exception as e:  # the device trap surfaces as an XLA error: report it, then fail like a user program would
    result("error", t=f"{time.time():.3f}", kind=type(e).__name__, message=repr(str(e).splitlines()[0][:300]))
    raise
result("finished", steps=a.steps)
