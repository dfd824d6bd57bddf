"""A small run of the CUDA backend in one process (NVLink kernels) for compute-sanitizer (memcheck / racecheck):
R=min(2, GPUs), T=17, H=256, K=4, E=8, two rounds of dispatch (bf16 and fp8), cached dispatch and combine on the CUDA
backend only, checked against NumPy expectations for the counts. Prints 'intranode_small: OK' at the end.

    compute-sanitizer --tool memcheck --kernel-name kns=jax_ep python3 tests/programs/sanitize/intranode_small.py
"""

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(TESTS, "gpu"), TESTS]  # the harness (tests/gpu) and what it imports (tests/helpers.py)

import numpy as np  # noqa: E402

import cuda_backend_harness as h  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cuda_backend_harness import cuda_backend  # noqa: E402
from jax_ep.config import EPConfig  # noqa: E402


def main():
    R, T, H, K, E = max(1, min(2, len(h.gpu_devices()))), 17, 256, 4, 8
    reason = h.skip_reason(R)
    if reason:
        print("intranode_small skipped:", reason)
        return
    cfg = EPConfig(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T, axis_name="ep", backend="cuda",
                   recv_capacity=20, timeout_seconds=60.0)
    group = h.Group(R, [cfg])

    def body(x, x8, s8, idx, w):
        o = cuda_backend.dispatch(x, None, idx, w, cfg, R)
        o8 = cuda_backend.dispatch(x8, s8, idx, w, cfg, R)
        y, yw = cuda_backend.combine(o.recv_x, o.recv_topk_weights, o.handle, cfg, R)
        c, cw = cuda_backend.cached_dispatch(x.astype(jnp.float32), w, o.handle, cfg, R)
        y32, _ = cuda_backend.combine(c, None, o.handle, cfg, R)
        return h.per_rank(dict(n=o.num_recv_tokens, n8=o8.num_recv_tokens, y=y, yw=yw, y32=y32, cw=cw))

    f = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep")))
    rng = np.random.default_rng(0)
    for round_ in range(2):
        x, _, idx, w = h.inputs(rng, R, T, H, K, E, "messy")
        x8, s8, _, _ = h.inputs(rng, R, T, H, K, E, "messy", fp8=True)
        out = jax.device_get(f(*(group.shard(a) for a in (x, x8, s8, idx, w))))
        valid = (idx >= 0) & (idx < E)
        in_rank = np.zeros((R * T, R), bool)
        for t in range(R * T):
            for e in idx[t][valid[t]]:
                in_rank[t, e // (E // R)] = True
        expect = [int(in_rank[:, r].sum()) for r in range(R)]
        assert out["n"].ravel().tolist() == expect, (out["n"], expect)
        assert out["n8"].ravel().tolist() == expect
        print(f"round {round_}: num_recv_tokens {expect}")
    group.close()
    print("intranode_small: OK")


if __name__ == "__main__":
    main()
