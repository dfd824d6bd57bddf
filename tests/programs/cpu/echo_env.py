"""Child program for tests/test_launch.py (no JAX computation): prints its launcher environment (and whether the
launcher joined it to the jax.distributed job) as JSON on stdout, a few lines on stdout and stderr, and a last
stdout line without a trailing newline.

    python -m jax_ep.launch -n N [opts] tests/programs/cpu/echo_env.py [args...]
    (cd tests/programs/cpu && python -m jax_ep.launch -n N [opts] -m echo_env [args...])
"""
import json
import os
import sys

KEYS = ["JAX_EP_COORDINATOR", "JAX_EP_NUM_PROCESSES", "JAX_EP_PROCESS_ID", "JAX_EP_LOCAL_RANK", "JAX_EP_LOCAL_SIZE",
        "JAX_EP_HOST_INDEX", "JAX_EP_NUM_HOSTS", "JAX_EP_JOIN_TIMEOUT", "CUDA_VISIBLE_DEVICES",
        "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_PREALLOCATE"]
rank = os.environ.get("JAX_EP_PROCESS_ID", "?")
info = {k: os.environ.get(k) for k in KEYS}
info["argv"] = sys.argv[1:]
info["name"] = __name__
info["pid"] = os.getpid()
jax = sys.modules.get("jax")  # imported by the launcher's child bootstrap; this program imports no JAX itself
info["joined"] = bool(jax is not None and jax.distributed.is_initialized())
print("ENV " + json.dumps(info, sort_keys=True), flush=True)
for j in range(3):
    print(f"stdout line {j} from rank {rank}", flush=True)
    print(f"stderr line {j} from rank {rank}", file=sys.stderr, flush=True)
sys.stdout.write(f"partial line from rank {rank}")
sys.stdout.flush()
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
if "--sleep" in sys.argv:
    import time
    print("\nsleeping", flush=True)
    time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
