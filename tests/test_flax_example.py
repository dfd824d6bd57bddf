"""examples/flax_moe.py (Flax NNX MoE block on jax_ep): it trains with the loss going down, and its forward pass is
the MoE layer it claims to be (checked against a dense float64 NumPy computation of the same layer).

Both run in subprocesses on 8 emulated CPU devices (the example sets XLA_FLAGS before importing jax). Skipped, with
the reason, when flax or optax is not installed (pip install -e ".[examples]").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jax_ep

pytest.importorskip("flax", reason="flax not installed (pip install -e '.[examples]')")
pytest.importorskip("optax", reason="optax not installed (pip install -e '.[examples]')")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "flax_moe.py"


def run(args, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    package_parent = str(Path(jax_ep.__file__).resolve().parent.parent)  # the jax_ep this test imported
    env["PYTHONPATH"] = os.pathsep.join([package_parent, str(EXAMPLE.parent)]
                                        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_trains_and_loss_goes_down(tmp_path):
    proc = run([str(EXAMPLE), "--steps", "8"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, f"flax_moe.py failed:\n{out}\n{proc.stderr}"
    assert "on 8 emulated CPU devices: backend reference, EP8" in out, out
    losses = [float(v) for v in re.findall(r"^step\s+\d+\s+loss ([0-9.]+)$", out, re.M)]
    assert len(losses) >= 3, out
    assert losses == sorted(losses, reverse=True), f"loss not decreasing step after step: {losses}"
    assert out.strip().splitlines()[-1].endswith("went down"), out


DENSE_CHECK = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flax import nnx
    import jax_ep, flax_moe

    mesh = Mesh(np.array(jax.devices("cpu")), ("ep",))
    R, T, H, F, K = mesh.size, 16, 64, 32, 2
    cfg = jax_ep.EPConfig(num_experts=2 * R, hidden=H, num_topk=K, max_tokens_per_rank=T)
    model = flax_moe.MoEBlock(cfg, F, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(model, nnx.Param)
    specs = flax_moe.param_specs(params)
    fwd = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh, in_specs=(specs, P("ep")),
                                out_specs=P("ep")))
    x = jax.random.normal(jax.random.key(4), (R * T, H), jnp.float32)
    y = np.asarray(fwd(params, x), np.float64)

    # The same layer, dense, in float64: every token through its top-k experts, weighted by the softmax of the
    # top-k logits; the experts see the bf16-rounded token (what crosses the wire).
    router = np.asarray(model.router.kernel[...], np.float64)
    w_in, w_out = np.asarray(model.w_in[...], np.float64), np.asarray(model.w_out[...], np.float64)
    xf = np.asarray(x, np.float64)
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    logits = xf @ router
    top = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    w = np.exp(np.take_along_axis(logits, top, 1))
    w /= w.sum(1, keepdims=True)
    gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
    want = np.zeros_like(xf)
    for t in range(R * T):
        for k in range(K):
            e = top[t, k]
            want[t] += w[t, k] * (gelu(xb[t] @ w_in[e]) @ w_out[e])
    err = np.linalg.norm(y - want) / np.linalg.norm(want)
    print(f"relative error vs dense: {err:.2e}")
    assert err < 1e-4, err
""")


def test_forward_matches_dense_layer(tmp_path):
    script = tmp_path / "dense_check.py"
    script.write_text(DENSE_CHECK)
    proc = run([str(script)], tmp_path)
    assert proc.returncode == 0, f"dense check failed:\n{proc.stdout}\n{proc.stderr}"
    assert "relative error vs dense" in proc.stdout
