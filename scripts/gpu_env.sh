# The environment of every GPU run of jax_ep. Sourced by scripts/gpu.sh; by hand: `. scripts/gpu_env.sh`.
# NVLink multicast stays off, always: NVSHMEM_DISABLE_NVLS=1 and NCCL_NVLS_ENABLE=0 are set whatever was set before
# and made read-only, so nothing later in the sourcing shell can unset or change them.
if [ "$(readonly -p | grep -cE ' (NVSHMEM_DISABLE_NVLS|NCCL_NVLS_ENABLE)=')" != 2 ]; then
  export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
  readonly NVSHMEM_DISABLE_NVLS NCCL_NVLS_ENABLE
fi
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# jax_ep allocates its own staging, so XLA must not take 75% of the GPU memory up front (a value set before wins)
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# NVSHMEM between the GPUs of this host only: no proxy transport (jax_ep's own default; a value set before wins)
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-none}
