"""Can another process map the buffers XLA hands a call? The question behind direct receive with one process per GPU.

For buffers XLA allocates on GPU 0 (a device_put array and a jitted output), prints what the driver says of each:
the handle types its allocation allows to export (CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, 1 = POSIX file
descriptor), its mapping's base and size, and the result of exporting the allocation as a file descriptor. Where the
export succeeds, a second process (no JAX; the driver API on GPU 1) receives the descriptor over a Unix socket,
imports and maps the allocation, and reads the array back through the mapping; "match" at the end of the line
"imported set access / read" means it could.

    XLA_PYTHON_CLIENT_PREALLOCATE=true python3 scripts/xla_buffer_export.py    # XLA's default pool
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/xla_buffer_export.py   # or: bash scripts/gpu.sh buffer-export

Needs two GPUs for the second process. Touches no GPU setting; every mapping is released before exit.
"""

import ctypes
import json
import os
import socket
import subprocess
import sys

CUDA_SUCCESS = 0
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
ATTR = {"legacy_ipc": 10, "allowed_handle_types": 14, "mapping_size": 18, "mapping_base": 19}
WORDS = 16  # int32 values read back through the mapping


def driver():
    cu = ctypes.CDLL("libcuda.so.1")
    if cu.cuInit(0) != CUDA_SUCCESS:
        raise SystemExit("cuInit failed")
    return cu


def use_device(cu, ordinal):
    """The device's primary context (the one XLA uses), made current."""
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for rc in (cu.cuDeviceGet(ctypes.byref(dev), ordinal), cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
               cu.cuCtxSetCurrent(ctx)):
        if rc != CUDA_SUCCESS:
            raise SystemExit(f"device {ordinal}: driver call failed with {rc}")
    return dev


def facts(cu, ptr):
    out = {}
    for name, attr in ATTR.items():
        value = ctypes.c_uint64(0)
        rc = cu.cuPointerGetAttribute(ctypes.byref(value), attr, ctypes.c_uint64(ptr))
        out[name] = value.value if rc == CUDA_SUCCESS else f"error {rc}"
    return out


def export_fd(cu, ptr):
    """(result, fd): the allocation holding ptr exported as a POSIX file descriptor."""
    handle = ctypes.c_uint64(0)
    rc = cu.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(ptr))
    if rc != CUDA_SUCCESS:
        return f"cuMemRetainAllocationHandle: {rc}", -1
    fd = ctypes.c_int(-1)
    rc = cu.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, ctypes.c_uint64(0))
    cu.cuMemRelease(handle)
    return ("ok" if rc == CUDA_SUCCESS else f"cuMemExportToShareableHandle: {rc}"), fd.value


def importer(sock_fd):
    """The second process: receive (fd, mapping size, offset), map the allocation for GPU 1, read it there."""
    cu = driver()
    dev = use_device(cu, 1)
    sock = socket.socket(fileno=sock_fd)
    msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    want = json.loads(msg)
    handle, va = ctypes.c_uint64(0), ctypes.c_uint64(0)
    size = want["mapping_size"]
    steps = [("import", lambda: cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fds[0]),
                                                                  POSIX_FD)),
             ("reserve", lambda: cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                                        ctypes.c_uint64(0), ctypes.c_uint64(0))),
             ("map", lambda: cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0)))]
    for name, call in steps:
        rc = call()
        if rc != CUDA_SUCCESS:
            print(f"imported {name}: {rc}")
            return
    # CUmemAccessDesc {CUmemLocation {type = DEVICE (1), id}, flags = READWRITE (3)}
    access = (ctypes.c_int * 3)(1, dev.value, 3)
    rc = cu.cuMemSetAccess(va, ctypes.c_size_t(size), access, ctypes.c_size_t(1))
    got = (ctypes.c_int32 * WORDS)()
    if rc == CUDA_SUCCESS:
        rc = cu.cuMemcpyDtoH_v2(got, ctypes.c_uint64(va.value + want["offset"]), ctypes.c_size_t(4 * WORDS))
    print("imported set access / read:", rc, "match" if list(got) == want["values"] else f"values {list(got)}")
    cu.cuMemUnmap(va, ctypes.c_size_t(size))
    cu.cuMemAddressFree(va, ctypes.c_size_t(size))
    cu.cuMemRelease(handle)


def main():
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        gpu = jax.devices("gpu")
    except RuntimeError as e:
        raise SystemExit(f"xla_buffer_export: no GPU ({e})")
    print("jax", jax.__version__, "devices", len(gpu), "XLA_PYTHON_CLIENT_PREALLOCATE",
          os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "(default)"),
          "XLA_PYTHON_CLIENT_ALLOCATOR", os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "(default)"))
    values = np.arange(1 << 20, dtype=np.int32) * 3 + 7
    arrays = {"device_put": jax.device_put(values, gpu[0])}
    arrays["jit output"] = jax.jit(lambda a: a * 2 + 1)(arrays["device_put"])
    arrays["jit output"].block_until_ready()
    cu = driver()
    use_device(cu, 0)
    exported = None
    for name, array in arrays.items():
        ptr = array.unsafe_buffer_pointer()
        f = facts(cu, ptr)
        result, fd = export_fd(cu, ptr)
        print(f"{name}: pointer {ptr:#x}", " ".join(f"{k} {v:#x}" if isinstance(v, int) and k.startswith("mapping")
                                                     else f"{k} {v}" for k, v in f.items()), "| export:", result)
        if fd >= 0 and exported is None and isinstance(f["mapping_base"], int):
            exported = (fd, f, ptr, np.asarray(array)[:WORDS].tolist())
        elif fd >= 0:
            os.close(fd)
    if exported is None:
        print("no allocation could be exported: another process cannot map these buffers")
        return
    if len(gpu) < 2:
        print("one GPU: the import by a second process is not tried")
        return
    fd, f, ptr, head = exported
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--import", str(child.fileno())],
                            pass_fds=[child.fileno()])
    child.close()
    msg = {"mapping_size": f["mapping_size"], "offset": ptr - f["mapping_base"], "values": head}
    socket.send_fds(parent, [json.dumps(msg).encode()], [fd])
    proc.wait(timeout=120)
    os.close(fd)
    print("second process exit status", proc.returncode)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--import":
        importer(int(sys.argv[2]))
    else:
        main()
