"""Shared test utilities: meshes, routing as DeepEP tests it, sharded runners, small configs, and why a GPU test
skips."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep


def ep_mesh(num_ranks: int, dp: int = 1) -> Mesh:
    """Mesh of the first dp * num_ranks devices (8 emulated CPU devices in CI; the GPUs on the GPU machine)."""
    if len(jax.devices()) < dp * num_ranks:
        import pytest
        pytest.skip(f"needs {dp * num_ranks} devices; this {jax.devices()[0].platform} machine has "
                    f"{len(jax.devices())}")
    devices = np.array(jax.devices()[: dp * num_ranks])
    if dp == 1:
        return Mesh(devices, ("ep",))
    return Mesh(devices.reshape(dp, num_ranks), ("dp", "ep"))


def random_topk(rng, num_tokens: int, num_experts: int, num_topk: int) -> np.ndarray:
    """DeepEP's test routing: scores |N(0,1)| + 1 per expert, top-k without repeats."""
    scores = np.abs(rng.normal(size=(num_tokens, num_experts))) + 1
    return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def sharded(fn, mesh: Mesh, num_in: int, spec=None):
    """jit(shard_map(fn)) with every input and output split along the leading axis over all mesh axes."""
    spec = spec or P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * num_in, out_specs=spec))


def run_sharded(fn, *args, num_ranks: int):
    """fn(*args) in jit(shard_map) over ep_mesh(num_ranks), every input and output split along the leading axis."""
    return sharded(fn, ep_mesh(num_ranks), len(args))(*args)


def config_maker(**defaults):
    """cfg(**changes): jax_ep.EPConfig(**defaults) (backend="reference" unless named) with `changes` applied; the
    error tests' small configs, one field changed at a time."""
    def cfg(**changes) -> jax_ep.EPConfig:
        return jax_ep.EPConfig(**{"backend": "reference", **defaults, **changes})

    return cfg


def cuda_gpu_count() -> int:
    """CUDA GPUs on this machine as nvidia-smi lists them (0 without it): no CUDA context in this process, for tests
    whose GPU work runs in child processes."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def cpu_child_env(drop_slurm: bool = False, **extra) -> dict:
    """The environment of a CPU child process (a launcher job or a program of the CPU suite): this one's without the
    suite's XLA_FLAGS, the launcher's JAX_NUM_CPU_DEVICES and CUDA_VISIBLE_DEVICES (and SLURM_* with drop_slurm:
    the launcher would read them as the job's shape), JAX_PLATFORMS=cpu, the repository first on PYTHONPATH, then
    `extra` (a None value leaves the variable unset)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not (drop_slurm and k.startswith("SLURM_"))}
    for k in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "CUDA_VISIBLE_DEVICES"):
        env.pop(k, None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


def gpu_child_env(*extra_paths: str, **extra: str) -> dict:
    """The environment of a GPU child process: this one's without the CPU suite's XLA_FLAGS / JAX_PLATFORMS, the GPU
    machines' settings (NVLink multicast off, no XLA preallocation), the repository (and extra_paths) on PYTHONPATH,
    then `extra` (which may set XLA_FLAGS again)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0",
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([root, *extra_paths] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def gpu_skip_reason(num_gpus: int, found: int | None = None, nvshmem: bool = False,
                    device_library: bool = False) -> str | None:
    """Why a GPU test cannot run here, or None. The GPUs come first (`found`: how many CUDA GPUs the caller counted,
    by default cuda_gpu_count()), so a machine without GPUs says so rather than naming a library it cannot use
    anyway; then the native extension; then, with nvshmem=True, the NVSHMEM module and, with device_library=True,
    its device library."""
    found = cuda_gpu_count() if found is None else found
    if found < num_gpus:
        return f"needs {num_gpus} CUDA GPU{'s' if num_gpus != 1 else ''}, found {found}"
    from jax_ep import _native

    if not _native.available():
        return f"native extension not built: {_native.load_error()}"
    if nvshmem or device_library:
        from jax_ep.runtime import nvshmem as nvshmem_runtime

        status = nvshmem_runtime.availability()
        if status != "available":
            return status
        if device_library and not nvshmem_runtime.module().has_device_library():
            return "jax_ep._jax_ep_nvshmem was built without NVSHMEM's device library"
    return None


def bf16(a) -> jax.Array:
    return jnp.asarray(a, jnp.bfloat16)


def non_finite_rows(num_tokens, hidden, seed):
    """bf16 rows (as f32) whose blocks hold: NaN, +inf, -inf, all three, all non-finite, all zero, zeros + NaN, none,
    tiny (amax below 448 * 2^-126: the scale would be subnormal), and small values with f32-subnormal channels."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((num_tokens, hidden)) * rng.choice([1e-3, 1.0, 300.0], (num_tokens, 1)))
    x = x.astype(np.float32)
    blocks = x.reshape(num_tokens, -1, 128)
    cases = ["nan", "inf", "-inf", "mixed", "all_non_finite", "all_zero", "zero_and_nan", "finite", "tiny",
             "subnormal"]
    for t in range(num_tokens):
        for b in range(blocks.shape[1]):
            case = cases[(t * blocks.shape[1] + b) % len(cases)]
            ch = rng.choice(128, size=3, replace=False)
            if case == "nan":
                blocks[t, b, ch[0]] = np.nan
            elif case == "inf":
                blocks[t, b, ch[0]] = np.inf
            elif case == "-inf":
                blocks[t, b, ch[:2]] = -np.inf
            elif case == "mixed":
                blocks[t, b, ch] = [np.nan, np.inf, -np.inf]
                blocks[t, b, (ch[0] + 1) % 128] = -np.nan  # a NaN with its sign bit set
            elif case == "all_non_finite":
                blocks[t, b] = np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), 128)
            elif case == "all_zero":
                blocks[t, b] = 0.0
            elif case == "zero_and_nan":
                blocks[t, b] = 0.0
                blocks[t, b, ch[0]] = np.nan
            elif case == "tiny":  # amax ~ 1e-37 < 448 * 2^-126 ~ 5.3e-36, one channel just below the threshold
                blocks[t, b] = rng.standard_normal(128).astype(np.float32) * np.float32(1e-37)
                blocks[t, b, ch[0]] = -5.0e-36
            elif case == "subnormal":  # a normal block near the threshold (2^-110) with subnormal channels
                blocks[t, b] = rng.standard_normal(128).astype(np.float32) * np.float32(2.0 ** -110)
                blocks[t, b, ch[:2]] = [3.0e-39, -1.0e-39]
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # exactly representable in bf16
