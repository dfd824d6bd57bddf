"""What every GPU child program in this folder does first (they run as scripts, directly or under
`python -m jax_ep.launch`, with this folder as sys.path[0]): the repository on sys.path, the environment the GPU
machines need, and the `RESULT <what> process=<pid> k=v ...` lines the tests parse."""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")


def prepare() -> None:
    sys.path.insert(0, ROOT)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def reporter(pid: int):
    def result(what, **kv):
        print(f"RESULT {what} process={pid} " + " ".join(f"{k}={v}" for k, v in kv.items()), flush=True)
    return result
