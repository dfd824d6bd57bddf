"""The NVSHMEM device-API check (nvshmem/device/device_check.cu) under compute-sanitizer: one process per GPU
through the NVSHMEM path, which runs the check kernel inside jax_ep.initialize (twice: initialize, finalize,
initialize). Works with one GPU (JAX_EP_TRANSPORT=nvshmem) or several (-n N). Prints 'device_check: OK'.

    JAX_EP_TRANSPORT=nvshmem compute-sanitizer --tool memcheck --report-api-errors no \
        --kernel-name kns=device_check python3 -m jax_ep.launch -n 1 tests/programs/sanitize/device_check.py
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

from jax_ep.launch import init_from_env

pid, nproc = init_from_env()

import numpy as np  # noqa: E402
import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_ep  # noqa: E402

mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("ep",))
cfg = jax_ep.EPConfig(8 * mesh.size, 256, 2, 8, backend="cuda", timeout_seconds=60.0)
for _ in range(2):
    rt = jax_ep.initialize(mesh, cfg)
    dc = rt.transport_state.summary()["device_check"]
    assert rt.transport == "nvshmem" and dc is not None and dc["complete"] == nproc, rt.summary()
    jax_ep.finalize()
print(f"device_check: OK (process {pid} of {nproc}: {dc})", flush=True)
