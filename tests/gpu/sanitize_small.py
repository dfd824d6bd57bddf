"""A small intranode run for compute-sanitizer (memcheck / racecheck): R=min(2, GPUs), T=17, H=256, K=4, E=8, two rounds of
dispatch (bf16 and fp8), cached dispatch and combine on the CUDA backend only, checked against NumPy expectations
for the counts. Prints 'sanitize_small: OK' at the end."""

import numpy as np

import intranode_harness as h

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from intranode_harness import cuda_backend
from jax_ep.config import EPConfig


def main():
    R, T, H, K, E = max(1, min(2, len(h.gpu_devices()))), 17, 256, 4, 8
    reason = h.skip_reason(R)
    if reason:
        print("sanitize_small skipped:", reason)
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
    print("sanitize_small: OK")


if __name__ == "__main__":
    main()
