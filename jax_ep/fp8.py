"""FP8 (e4m3) block quantization used by low-latency dispatch (docs/API.md defines it exactly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import FP8_BLOCK

E4M3_MAX = 448.0


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, H // 128] f32) with x ~ q * scale per 128 channels.

    In f32: scale = amax * f32(1/448) and q = e4m3(x * (1 / scale)) (round to nearest even; 1 / scale an IEEE
    division) when amax > 0; an all-zero block gets scale 1 and q 0, so dequantization gives exact zeros and
    1 / scale stays finite. Multiplications rather than divisions by x-dependent values: a CUDA kernel reproduces
    this bit for bit, and XLA would rewrite a division by a constant into this form anyway.
    """
    tokens, hidden = x.shape
    blocks = x.astype(jnp.float32).reshape(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=2)
    scales = jnp.where(amax > 0, amax * jnp.float32(1.0 / E4M3_MAX), 1.0).astype(jnp.float32)
    inverse = jnp.float32(1.0) / scales
    q = (blocks * inverse[..., None]).astype(jnp.float8_e4m3fn).reshape(tokens, hidden)
    return q, scales


def dequantize_blocks(q: jax.Array, scales: jax.Array) -> jax.Array:
    """Inverse of quantize_blocks up to rounding: [..., H] fp8 and [..., H // 128] f32 -> f32."""
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, FP8_BLOCK)
    return (blocks * scales[..., None]).reshape(q.shape)
