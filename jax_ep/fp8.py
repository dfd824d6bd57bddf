"""FP8 (e4m3) block quantization used by low-latency dispatch (docs/API.md defines it exactly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .config import FP8_BLOCK

E4M3_MAX = 448.0
E4M3_NAN_BITS = 0x7F  # the e4m3fn NaN code every non-finite channel becomes (the CUDA kernel stores the same byte)
F32_MIN_NORMAL = 2.0 ** -126
# Blocks whose amax is below this get scale 1 (their scale amax / 448 would be an f32 subnormal, which XLA:CPU
# flushes to zero and a GPU keeps: the rule avoids the difference). 448 * 2^-126 = 7 * 2^-120, exact in f32.
MIN_AMAX = E4M3_MAX * F32_MIN_NORMAL


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, H // 128] f32) with x ~ q * scale per 128 channels.

    In f32, per token and block of 128 channels: amax = max |x| over the block's finite channels (0 if none);
    scale = amax * f32(1/448) and q = e4m3(x * (1 / scale)) (round to nearest even; 1 / scale an IEEE division)
    when amax >= 448 * 2^-126; a block below that (all zeros, or values under ~5.3e-36) gets scale 1, so its q are
    +-0 and 1 / scale stays finite. Channels with |x| < 2^-126 (f32 subnormals) count as +-0 (sign kept), on every
    platform (XLA:CPU flushes subnormals, GPUs do not: the rule says what both compute). Non-finite channels (NaN,
    +inf, -inf) become the e4m3fn NaN code 0x7F and do not affect the scale or the other channels: NaN propagates to
    exactly the channels that were non-finite.
    Multiplications rather than divisions by x-dependent values: a CUDA kernel reproduces this bit for bit, and XLA
    would rewrite a division by a constant into this form anyway.
    """
    tokens, hidden = x.shape
    blocks = x.astype(jnp.float32).reshape(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    blocks = jnp.where(jnp.abs(blocks) < jnp.float32(F32_MIN_NORMAL), jnp.copysign(jnp.float32(0.0), blocks), blocks)
    finite = jnp.isfinite(blocks)
    amax = jnp.max(jnp.where(finite, jnp.abs(blocks), 0.0), axis=2)
    scales = jnp.where(amax >= jnp.float32(MIN_AMAX), amax * jnp.float32(1.0 / E4M3_MAX), 1.0).astype(jnp.float32)
    inverse = jnp.float32(1.0) / scales
    q = (jnp.where(finite, blocks, 0.0) * inverse[..., None]).astype(jnp.float8_e4m3fn)
    bits = jnp.where(finite, lax.bitcast_convert_type(q, jnp.uint8), jnp.uint8(E4M3_NAN_BITS))
    return lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).reshape(tokens, hidden), scales


def dequantize_blocks(q: jax.Array, scales: jax.Array) -> jax.Array:
    """Inverse of quantize_blocks up to rounding: [..., H] fp8 and [..., H // 128] f32 -> f32."""
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, FP8_BLOCK)
    return (blocks * scales[..., None]).reshape(q.shape)
