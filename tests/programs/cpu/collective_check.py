"""Child program for tests/test_launch.py: join the launcher's job, check the topology, run CPU collectives.

    python -m jax_ep.launch -n N --no-gpu-pinning tests/programs/cpu/collective_check.py [--devices-per-process K]

Each process owns K CPU devices; the global mesh spans all N*K of them. Prints one `RESULT ...` line per check
with the value-checked outcome; exits non-zero (AssertionError) on any mismatch.
"""
import argparse
import os

from _child import global_array, global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--devices-per-process", type=int, default=1)
ap.add_argument("--platform", default="cpu", help="cpu (default; emulated devices) or gpu (one per process)")
a = ap.parse_args()
pid, n = join_job(a.platform, a.devices_per_process)

import jax  # noqa: E402
from jax_ep.launch import init_from_env  # noqa: E402

assert init_from_env() == (pid, n), "init_from_env is not idempotent"

import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

K = a.devices_per_process
assert pid == int(os.environ["JAX_EP_PROCESS_ID"]), (pid, os.environ["JAX_EP_PROCESS_ID"])
assert n == int(os.environ["JAX_EP_NUM_PROCESSES"]), (n, os.environ["JAX_EP_NUM_PROCESSES"])
assert jax.process_count() == n, f"jax.process_count()={jax.process_count()} != {n}"
assert jax.process_index() == pid, f"jax.process_index()={jax.process_index()} != {pid}"
assert jax.local_device_count() == K, (jax.local_device_count(), K)
G = jax.device_count()
assert G == n * K, f"jax.device_count()={G} != {n}*{K}"
print(f"RESULT topology process={pid}/{n} devices={G} local={K} "
      f"env NVSHMEM_DISABLE_NVLS={os.environ.get('NVSHMEM_DISABLE_NVLS')} "
      f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')} "
      f"XLA_PYTHON_CLIENT_PREALLOCATE={os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}", flush=True)

devices = global_devices()
mesh = Mesh(np.array(devices), ("x",))
sh = NamedSharding(mesh, P("x"))
# global row g = [g+1, 10*(g+1), ...]: every rank's contribution is distinct
glob = (np.arange(G, dtype=np.float32)[:, None] + 1) * (10.0 ** np.arange(4, dtype=np.float32))[None, :]
arr = global_array(sh, devices, glob)

psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
out = psum(arr)
want = glob.sum(0)
for s in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data)[0], want)
print(f"RESULT psum process={pid} value={np.asarray(out.addressable_shards[0].data)[0].tolist()}", flush=True)

# all_to_all: rank g sends [g*G + j] to rank j; rank j receives [g*G + j for g in range(G)]
src = np.arange(G * G, dtype=np.int32).reshape(G, G)
arr2 = global_array(sh, devices, src)
a2a = jax.jit(jax.shard_map(lambda v: jax.lax.all_to_all(v, "x", 1, 1, tiled=True), mesh=mesh,
                            in_specs=P("x"), out_specs=P("x")))
out2 = a2a(arr2)
for s in out2.addressable_shards:
    j = s.index[0].start
    np.testing.assert_array_equal(np.asarray(s.data)[0], src[:, j])
print(f"RESULT all_to_all process={pid} rows_ok={[s.index[0].start for s in out2.addressable_shards]}", flush=True)

# a global reduction through jit (no shard_map): XLA inserts the cross-process all-reduce
tot = jax.jit(lambda v: jnp.sum(v), out_shardings=NamedSharding(mesh, P()))(arr2)
assert int(tot) == int(src.sum()), (int(tot), int(src.sum()))
print(f"RESULT jit_sum process={pid} value={int(tot)}", flush=True)
print(f"RESULT done process={pid}", flush=True)
