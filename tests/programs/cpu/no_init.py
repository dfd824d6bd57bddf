"""Child program for tests/test_launch*.py: an unchanged JAX script (it never calls init_from_env nor
jax.distributed.initialize) started by the launcher must already be one process of the whole job.

    python -m jax_ep.launch -n N [--num-hosts H --host-index I --coordinator HOST:PORT] no_init.py [--devices K]

Checks, before creating any backend, that jax.distributed is initialized with the launcher's global process id,
that init_from_env() is then a no-op returning the same (and creates no backend: K CPU devices can still be
configured after it); then a psum over every process's devices. Prints `RESULT ...` lines.
"""
import argparse
import os

from _child import global_array, global_devices, use_cpu

import jax  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=1)
a = ap.parse_args()

env = os.environ
pid, n = int(env["JAX_EP_PROCESS_ID"]), int(env["JAX_EP_NUM_PROCESSES"])
assert jax.distributed.is_initialized(), "the launcher did not join the job before the program"
from jax_ep.launch import init_from_env  # noqa: E402

assert init_from_env() == (pid, n), (init_from_env(), pid, n)
assert not xla_bridge.backends_are_initialized(), "init_from_env created the backends"
use_cpu(a.devices)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

assert (jax.process_index(), jax.process_count()) == (pid, n), (jax.process_index(), jax.process_count(), pid, n)
assert jax.local_device_count() == a.devices and jax.device_count() == n * a.devices
where = {k: env.get(k) for k in ("JAX_EP_LOCAL_RANK", "JAX_EP_LOCAL_SIZE", "JAX_EP_HOST_INDEX", "JAX_EP_NUM_HOSTS",
                                 "CUDA_VISIBLE_DEVICES", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE")}
print(f"RESULT joined process={pid}/{n} devices={jax.device_count()} {' '.join(f'{k}={v}' for k, v in where.items())}",
      flush=True)

devices = global_devices()
mesh = Mesh(np.array(devices), ("x",))
G = len(devices)
glob = np.arange(1, G + 1, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
arr = global_array(NamedSharding(mesh, P("x")), devices, glob)
out = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))(arr)
value = float(np.asarray(out.addressable_shards[0].data)[0, 0])
assert value == G * (G + 1) / 2, value
print(f"RESULT psum process={pid} value={value:g}", flush=True)
