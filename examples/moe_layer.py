"""A complete MoE layer on jax_ep, trained for a few steps (normal mode) or run as a decode step (low latency).

    python examples/moe_layer.py                      # train: router, top-k, dispatch, ragged_dot FFN, combine
    python examples/moe_layer.py --mode low_latency   # decode step: fp8 low-latency dispatch, per-expert FFN

Runs on every GPU of the machine with the CUDA backend where it is built, else on 8 emulated CPU devices with the
reference backend (the script says which). Experts are sharded over the mesh axis 'ep'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Emulated CPU devices must be requested before jax is imported; harmless where GPUs exist.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402


def make_params(key, num_experts, hidden, ffn):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k1, (hidden, num_experts), jnp.float32) * hidden ** -0.5,
        "w_in": jax.random.normal(k2, (num_experts, hidden, ffn), jnp.float32) * hidden ** -0.5,
        "w_out": jax.random.normal(k3, (num_experts, ffn, hidden), jnp.float32) * ffn ** -0.5,
    }


PARAM_SPECS = {"router": P(), "w_in": P("ep"), "w_out": P("ep")}


def route(x, router, num_topk):
    logits = x.astype(jnp.float32) @ router
    top_logits, topk_idx = jax.lax.top_k(logits, num_topk)
    return topk_idx.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)


def experts_ragged(rows, recv_topk_idx, recv_topk_weights, w_in, w_out):
    """FFN of the local experts on the received rows with jax.lax.ragged_dot.

    Each (row, k) pair naming a local expert becomes one input of that expert's group; outputs are weighted by
    the routing weight and summed back into the row (pairs naming other ranks' experts have idx -1).
    """
    capacity, num_topk = recv_topk_idx.shape
    num_local = w_in.shape[0]
    pair_expert = recv_topk_idx.reshape(-1)
    order = jax_ep.backends.reference.stable_argsort(jnp.where(pair_expert >= 0, pair_expert, num_local))
    group_sizes = jnp.sum(pair_expert[:, None] == jnp.arange(num_local), axis=0, dtype=jnp.int32)
    pair_rows = (order // num_topk).astype(jnp.int32)
    lhs = rows[pair_rows].astype(jnp.float32)
    hidden = jax.nn.gelu(jax.lax.ragged_dot(lhs, w_in, group_sizes))
    out = jax.lax.ragged_dot(hidden, w_out, group_sizes)
    weight = jnp.where(pair_expert[order] >= 0, recv_topk_weights.reshape(-1)[order], 0.0)
    return jnp.zeros((capacity, out.shape[1]), jnp.float32).at[pair_rows].add(out * weight[:, None])


def moe_forward(params, x, cfg):
    """x [T, H] bf16 on this rank -> [T, H] f32: sum_k w[t, k] * FFN_{e_k}(x[t])."""
    topk_idx, weights = route(x, params["router"], cfg.num_topk)
    out = jax_ep.dispatch(x, topk_idx, weights, cfg)
    expert_out = experts_ragged(out.recv_x, out.recv_topk_idx, out.recv_topk_weights, params["w_in"],
                                params["w_out"])
    y, _ = jax_ep.combine(expert_out, out.handle, cfg)
    return y


def decode_step(params, x, cfg, use_fp8=True):
    """Low-latency path: fp8 dispatch into per-expert rows, batched expert FFN, weighted combine."""
    topk_idx, weights = route(x, params["router"], cfg.num_topk)
    ll = jax_ep.low_latency_dispatch(x, topk_idx, cfg, use_fp8=use_fp8)
    if use_fp8:
        rows = jax_ep.fp8.dequantize_blocks(ll.recv_x, ll.recv_x_scales)  # [L, R*T_max, H] f32
    else:
        rows = ll.recv_x.astype(jnp.float32)
    hidden = jax.nn.gelu(jnp.einsum("lrh,lhf->lrf", rows, params["w_in"]))
    expert_out = jnp.einsum("lrf,lfh->lrh", hidden, params["w_out"]).astype(jnp.bfloat16)
    return jax_ep.low_latency_combine(expert_out, topk_idx, weights, ll.handle, cfg)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["normal", "low_latency"], default="normal")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--lr", type=float, default=20.0)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"])
    parser.add_argument("--no-fp8", action="store_true", help="low-latency mode: dispatch bf16 instead of fp8")
    args = parser.parse_args(argv)

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    devices = gpus or jax.devices("cpu")
    where = f"{len(gpus)} GPU(s)" if gpus else f"{len(devices)} emulated CPU devices"
    mesh = Mesh(np.array(devices), ("ep",))
    num_ranks = len(devices)
    cfg = jax_ep.EPConfig(num_experts=args.experts_per_rank * num_ranks, hidden=args.hidden, num_topk=args.topk,
                          max_tokens_per_rank=args.tokens, backend=args.backend)
    rt = jax_ep.initialize(mesh, cfg)
    print(f"jax_ep MoE layer ({args.mode}) on {where}: backend {rt.backends[cfg]}, EP{num_ranks}, "
          f"E={cfg.num_experts} H={cfg.hidden} K={cfg.num_topk} T={args.tokens}/rank")

    key = jax.random.PRNGKey(0)
    params = make_params(key, cfg.num_experts, args.hidden, args.ffn)
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    params = jax.device_put(params, {k: shard(v) for k, v in PARAM_SPECS.items()})
    x = jax.random.normal(jax.random.fold_in(key, 1), (num_ranks * args.tokens, args.hidden), jnp.float32)
    teacher = jax.random.normal(jax.random.fold_in(key, 2), (args.hidden, args.hidden)) * args.hidden ** -0.5
    target = jax.device_put(jnp.tanh(x @ teacher), shard(P("ep")))
    x = jax.device_put(x.astype(jnp.bfloat16), shard(P("ep")))

    if args.mode == "low_latency":
        step = jax.jit(jax.shard_map(lambda p, x: decode_step(p, x, cfg, not args.no_fp8), mesh=mesh,
                                     in_specs=(PARAM_SPECS, P("ep")), out_specs=P("ep")))
        y = step(params, x).block_until_ready()
        t0 = time.perf_counter()
        y = step(params, x).block_until_ready()
        elapsed = time.perf_counter() - t0
        dense = dense_reference(params, x, cfg.num_topk)
        got = np.asarray(jax.device_get(y).astype(np.float32), np.float64)
        err = float(np.linalg.norm(got - dense) / np.linalg.norm(dense))
        print(f"decode step: {1e6 * elapsed:.0f} us; relative error vs dense layer {err:.3e} "
              f"({'bf16' if args.no_fp8 else 'fp8'} dispatch)")
        return 0 if err < 0.1 else 1

    def loss_fn(params, x, target):
        y = jax.shard_map(lambda p, x: moe_forward(p, x, cfg), mesh=mesh, in_specs=(PARAM_SPECS, P("ep")),
                          out_specs=P("ep"))(params, x)
        return jnp.mean((y - target) ** 2)

    @jax.jit
    def train_step(params, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        return jax.tree.map(lambda p, g: p - args.lr * g, params, grads), loss

    losses = []
    for i in range(args.steps):
        params, loss = train_step(params, x, target)
        losses.append(float(loss))
        if i % max(1, args.steps // 6) == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.5f}")
    ok = losses[-1] < 0.8 * losses[0]
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}: {'went down' if ok else 'did NOT go down'}")
    jax_ep.finalize()
    return 0 if ok else 1


def dense_reference(params, x, num_topk):
    """The same layer computed on the host in float64 with every expert dense (checks the decode step).

    Runs in NumPy on gathered arrays, independent of the mesh, the shardings and the device's matmul precision.
    """
    p = {k: np.asarray(v, np.float64) for k, v in jax.device_get(params).items()}
    xf = np.asarray(jax.device_get(x).astype(np.float32), np.float64)
    logits = xf @ p["router"]
    topk_idx = np.argsort(-logits, axis=1, kind="stable")[:, :num_topk]
    top = np.take_along_axis(logits, topk_idx, axis=1)
    weights = np.exp(top - top.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    hidden = np.asarray(jax.nn.gelu(jnp.asarray(np.einsum("th,ehf->etf", xf, p["w_in"]), jnp.float32)), np.float64)
    per_expert = np.einsum("etf,efh->eth", hidden, p["w_out"])
    picked = per_expert[topk_idx, np.arange(xf.shape[0])[:, None]]
    return np.einsum("tk,tkh->th", weights, picked)


if __name__ == "__main__":
    sys.exit(main())
