"""What the CPU child programs in this folder share. They run as scripts, directly or under
`python -m jax_ep.launch`, with this folder as sys.path[0]; importing this module puts the repository (jax_ep) and
tests/ (oracle, helpers) on sys.path."""
import os
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
for _path in (os.path.join(ROOT, "tests"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def use_cpu(num_devices: int) -> None:
    """This process's JAX devices: num_devices emulated CPU devices (before any JAX backend exists)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", num_devices)


def join_job(platform: str, num_devices: int):
    """use_cpu(num_devices) when platform is "cpu" (else the GPUs, one per process), then join the launcher's
    jax.distributed job: (process id, number of processes)."""
    if platform == "cpu":
        use_cpu(num_devices)
    from jax_ep.launch import init_from_env

    return init_from_env()


def global_devices():
    """Every process's devices in global rank order (process index, then device id): the meshes' order."""
    import jax

    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def global_array(sharding, devices, value):
    """value (the whole global array, one row per device of `devices`, the same on every process) as a global array
    sharded over its first axis: each process fills its own devices' rows."""
    import jax

    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    return jax.make_array_from_process_local_data(sharding, value[mine], value.shape)
