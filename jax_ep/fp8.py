"""FP8 (e4m3) block quantization used by low-latency dispatch (docs/API.md defines it exactly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .config import FP8_BLOCK

E4M3_MAX = 448.0
E4M3_NAN_BITS = 0x7F  # the e4m3fn NaN code every non-finite channel becomes (the CUDA kernel stores the same byte)


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, H // 128] f32) with x ~ q * scale per 128 channels.

    In f32, per token and block of 128 channels: amax = max |x| over the block's finite channels (0 if none);
    scale = amax * f32(1/448) and q = e4m3(x * (1 / scale)) (round to nearest even; 1 / scale an IEEE division)
    when amax > 0; a block without a finite nonzero channel gets scale 1 (dequantization gives exact zeros and
    1 / scale stays finite). Non-finite channels (NaN, +inf, -inf) become the e4m3fn NaN code 0x7F and do not affect
    the scale or the other channels: NaN propagates to exactly the channels that were non-finite.
    Multiplications rather than divisions by x-dependent values: a CUDA kernel reproduces this bit for bit, and XLA
    would rewrite a division by a constant into this form anyway.
    """
    tokens, hidden = x.shape
    blocks = x.astype(jnp.float32).reshape(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    finite = jnp.isfinite(blocks)
    amax = jnp.max(jnp.where(finite, jnp.abs(blocks), 0.0), axis=2)
    scales = jnp.where(amax > 0, amax * jnp.float32(1.0 / E4M3_MAX), 1.0).astype(jnp.float32)
    inverse = jnp.float32(1.0) / scales
    q = (jnp.where(finite, blocks, 0.0) * inverse[..., None]).astype(jnp.float8_e4m3fn)
    bits = jnp.where(finite, lax.bitcast_convert_type(q, jnp.uint8), jnp.uint8(E4M3_NAN_BITS))
    return lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).reshape(tokens, hidden), scales


def dequantize_blocks(q: jax.Array, scales: jax.Array) -> jax.Array:
    """Inverse of quantize_blocks up to rounding: [..., H] fp8 and [..., H // 128] f32 -> f32."""
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, FP8_BLOCK)
    return (blocks * scales[..., None]).reshape(q.shape)
