"""Child program for tests/test_multiprocess_runtime.py: multi-process jax_ep.initialize agreement, on CPU.

--case same      every process initializes the same config twice over (finalize in between): both succeed
--case hidden    process 1 passes another hidden size: every process gets an EPError naming configs[0].hidden
--case mesh      process 1 builds its mesh with another axis name: the error names the mesh axis names
--case put_bytes process 1 sets JAX_EP_LOW_LATENCY_PUT_BYTES=4096 (kernel variable): the error names the variable
--case warmup_ops process 1 passes warmup_ops=False: the error names warmup_ops (after the setup agreed)
--case absent    process 1 never calls initialize: process 0 gets an EPError after EPConfig.timeout_seconds
Prints `RESULT <case> process=<i> ok|error=<message> seconds=<s>` and exits 0 (the test reads the lines).
"""
import argparse
import os
import sys
import time

from _child import global_devices, join_job

ap = argparse.ArgumentParser()
ap.add_argument("--case", required=True, choices=["same", "hidden", "mesh", "put_bytes", "warmup_ops", "absent"])
a = ap.parse_args()
pid, nproc = join_job("cpu", 1)

import jax  # noqa: E402

import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_ep  # noqa: E402

devices = global_devices()
axis = "other" if (a.case == "mesh" and pid == 1) else "ep"
mesh = Mesh(np.array(devices), (axis,))
if a.case == "put_bytes" and pid == 1:
    os.environ["JAX_EP_LOW_LATENCY_PUT_BYTES"] = "4096"
hidden = 256 if (a.case == "hidden" and pid == 1) else 128
cfg = jax_ep.EPConfig(num_experts=4 * nproc, hidden=hidden, num_topk=2, max_tokens_per_rank=8, axis_name=axis,
                      backend="reference", timeout_seconds=3.0)

t0 = time.monotonic()
if a.case == "absent" and pid == 1:
    time.sleep(8)  # never initializes; stays alive past process 0's wait
    print(f"RESULT absent process={pid} ok (did not initialize) seconds={time.monotonic() - t0:.2f}", flush=True)
    sys.exit(0)
try:
    rt = jax_ep.initialize(mesh, cfg, warmup_ops=not (a.case == "warmup_ops" and pid == 1))
    assert rt.process_model == "multi-process" and "agree" in rt.timings, rt
    if a.case == "same":
        jax_ep.finalize()
        rt = jax_ep.initialize(mesh, cfg)  # a second generation of keys
        assert "agree" in rt.timings
    print(f"RESULT {a.case} process={pid} ok seconds={time.monotonic() - t0:.2f}", flush=True)
except jax_ep.EPError as e:
    msg = str(e).replace("\n", " ")
    print(f"RESULT {a.case} process={pid} error={msg} seconds={time.monotonic() - t0:.2f}", flush=True)
