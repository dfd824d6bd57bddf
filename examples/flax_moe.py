"""An MoE block written with Flax NNX on jax_ep, trained for a few steps with optax under jit + shard_map.

    python examples/flax_moe.py                 # 30 steps; prints the loss going down
    python examples/flax_moe.py --steps 5 --backend reference

The block: a router (nnx.Linear), top-k with softmax weights, `jax_ep.dispatch` of each token to the ranks that
hold its experts, the local experts' FFN with `jax.lax.ragged_dot` over the received rows grouped by local expert,
and `jax_ep.combine` back to the tokens' ranks. Experts are sharded over the mesh axis "ep"; the router is
replicated. It runs on every GPU of the machine with the CUDA backend where the extension is built, else on 8
emulated CPU devices with the reference backend (backend="auto"; the first line says which).

Needs the `examples` extra: pip install "jax_ep[examples]" (flax, optax).
"""

from __future__ import annotations

import argparse
import os
import sys

# Emulated CPU devices must be requested before jax is imported; harmless where GPUs exist.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

try:
    import optax
    from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
    sys.exit(f"examples/flax_moe.py needs flax and optax: pip install \"jax_ep[examples]\" ({e})")

import jax_ep  # noqa: E402

EXPERT_PARAMS = ("w_in", "w_out")  # sharded over the EP axis (dim 0 = experts); everything else is replicated


class MoEBlock(nnx.Module):
    """Top-k MoE feed-forward block over jax_ep. Call it inside `shard_map` over `cfg.axis_name`.

    Created with the global expert weights w_in [E, H, F] and w_out [E, F, H]; inside shard_map each rank sees its
    L = E / R experts (rank r holds experts r*L .. r*L + L - 1, jax_ep's layout).
    """

    def __init__(self, cfg: jax_ep.EPConfig, ffn: int, *, rngs: nnx.Rngs):
        hidden, num_experts = cfg.hidden, cfg.num_experts
        self.cfg = cfg  # static (hashable): part of the graph definition, not of the state
        self.router = nnx.Linear(hidden, num_experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (num_experts, hidden, ffn)) * hidden ** -0.5)
        self.w_out = nnx.Param(jax.random.normal(rngs.params(), (num_experts, ffn, hidden)) * ffn ** -0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, H] f32, this rank's tokens -> [T, H] f32: sum_k weight[t, k] * FFN_{expert k of t}(x[t])."""
        cfg = self.cfg
        logits = self.router(x)
        top_logits, topk_idx = jax.lax.top_k(logits, cfg.num_topk)
        weights = jax.nn.softmax(top_logits, axis=-1)  # f32 [T, K]; the router learns through these
        # bf16 on the wire (jax_ep.dispatch also takes f32 x and does this cast itself: docs/API.md).
        out = jax_ep.dispatch(x.astype(jnp.bfloat16), topk_idx.astype(jnp.int32), weights, cfg)
        expert_out = self.experts(out.recv_x, out.recv_topk_idx, out.recv_topk_weights)
        y, _ = jax_ep.combine(expert_out, out.handle, cfg)  # f32 expert_out -> f32 y
        return y

    def experts(self, rows: jax.Array, recv_topk_idx: jax.Array, recv_topk_weights: jax.Array) -> jax.Array:
        """The local experts on the received rows [C, H]: one ragged_dot group per local expert.

        Each (row, k) pair that names a local expert (recv_topk_idx >= 0) is one input row of that expert's group;
        its output is weighted by the routing weight and added into the row. Pairs with -1 (experts on other
        ranks) and padding rows form a trailing group that ragged_dot leaves out.
        """
        w_in, w_out = self.w_in[...], self.w_out[...]  # [L, H, F], [L, F, H]: this rank's experts
        capacity, num_topk = recv_topk_idx.shape
        num_local = w_in.shape[0]
        pair_expert = recv_topk_idx.reshape(-1)
        group = jnp.where(pair_expert >= 0, pair_expert, num_local)
        order = jnp.argsort(group, stable=True)  # pairs grouped by local expert, row order within a group
        group_sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
        pair_rows = order // num_topk
        hidden = jax.nn.gelu(jax.lax.ragged_dot(rows[pair_rows].astype(jnp.float32), w_in, group_sizes))
        pair_out = jax.lax.ragged_dot(hidden, w_out, group_sizes)  # [C*K, H]
        keep = group[order] < num_local
        pair_out = jnp.where(keep[:, None], pair_out * recv_topk_weights.reshape(-1)[order][:, None], 0.0)
        return jnp.zeros((capacity, pair_out.shape[1]), jnp.float32).at[pair_rows].add(pair_out)


def param_specs(params):
    """PartitionSpecs for the model state: expert weights split over "ep" on dim 0, the rest replicated."""
    def spec(path, _):
        return P("ep") if getattr(path[0], "key", None) in EXPERT_PARAMS else P()
    return jax.tree_util.tree_map_with_path(spec, params)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"])
    args = parser.parse_args(argv)

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    devices = gpus or jax.devices("cpu")
    mesh = Mesh(np.array(devices), ("ep",))
    num_ranks = len(devices)
    cfg = jax_ep.EPConfig(num_experts=args.experts_per_rank * num_ranks, hidden=args.hidden, num_topk=args.topk,
                          max_tokens_per_rank=args.tokens, backend=args.backend)
    rt = jax_ep.initialize(mesh, cfg)
    where = f"{len(gpus)} GPU(s)" if gpus else f"{num_ranks} emulated CPU devices"
    print(f"Flax NNX MoE block on {where}: backend {rt.backends[cfg]}, EP{num_ranks}, E={cfg.num_experts} "
          f"H={cfg.hidden} K={cfg.num_topk} T={args.tokens}/rank")

    model = MoEBlock(cfg, args.ffn, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    specs = param_specs(params)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda s: isinstance(s, P)))

    def forward(params, x):  # one rank: its shard of the state, its tokens
        return nnx.merge(graphdef, params)(x)

    sharded_forward = jax.shard_map(forward, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))

    # A teacher to imitate: a fixed random nonlinear map of the tokens.
    key = jax.random.key(1)
    x = jax.random.normal(key, (num_ranks * args.tokens, args.hidden), jnp.float32)
    teacher = jax.random.normal(jax.random.fold_in(key, 1), (args.hidden, args.hidden)) * args.hidden ** -0.5
    target = jnp.tanh(x @ teacher)
    x, target = (jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, target))

    def loss_fn(params, x, target):
        return jnp.mean((sharded_forward(params, x) - target) ** 2)

    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state, x, target)
        losses.append(float(loss))
        if i % max(1, args.steps // 6) == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.5f}")
    nnx.update(model, params)  # the trained weights back into the module
    ok = losses[-1] < 0.9 * losses[0]
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}: {'went down' if ok else 'did NOT go down'}")
    jax_ep.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
