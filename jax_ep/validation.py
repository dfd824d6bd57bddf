"""Trace-time argument checks (SPEC §6): each failure names the argument and the expected value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import FP8_BLOCK, EPConfig


from .errors import EPError, EPTypeError  # noqa: F401  (re-exported: validation is where callers look)


def check_config(op: str, cfg) -> None:
    if not isinstance(cfg, EPConfig):
        raise EPError(f"jax_ep.{op}: cfg must be an EPConfig, got {type(cfg).__name__}")


def group_size(cfg: EPConfig, op: str) -> int:
    """R: the size of mesh axis cfg.axis_name; fails clearly outside shard_map over that axis."""
    try:
        size = jax.lax.axis_size(cfg.axis_name)
    except NameError:
        raise EPError(
            f"jax_ep.{op} must be called inside jax.shard_map over mesh axis cfg.axis_name="
            f"{cfg.axis_name!r}; that axis is not bound here") from None
    try:
        cfg.check_num_ranks(size)
    except ValueError as e:
        raise EPError(f"jax_ep.{op}: {e}") from None
    return int(size)


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def check_array(op: str, name: str, a, shape, dtypes) -> None:
    """shape: tuple with None for 'any'; dtypes: a tuple of allowed dtypes."""
    if a is None or not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise EPError(f"jax_ep.{op}: {name} must be an array, got {type(a).__name__}")
    if a.dtype not in [np.dtype(d) for d in dtypes]:
        want = " or ".join(_dtype_name(d) for d in dtypes)
        raise EPTypeError(f"jax_ep.{op}: {name} must have dtype {want}, got {_dtype_name(a.dtype)}")
    if len(a.shape) != len(shape):
        raise EPError(f"jax_ep.{op}: {name} must have rank {len(shape)} (shape {_fmt(shape)}), "
                      f"got shape {tuple(a.shape)}")
    for got, want in zip(a.shape, shape):
        if want is not None and got != want:
            raise EPError(f"jax_ep.{op}: {name} must have shape {_fmt(shape)}, got {tuple(a.shape)}")


def _fmt(shape) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def check_tokens(op: str, name: str, num_tokens: int, cfg: EPConfig) -> None:
    if num_tokens < 1 or num_tokens > cfg.max_tokens_per_rank:
        raise EPError(f"jax_ep.{op}: {name} has {num_tokens} tokens per rank; expected 1 <= T <= "
                      f"cfg.max_tokens_per_rank ({cfg.max_tokens_per_rank})")


def check_fp8_hidden(op: str, cfg: EPConfig) -> None:
    if cfg.hidden % FP8_BLOCK != 0:
        raise EPError(f"jax_ep.{op}: fp8 needs cfg.hidden to be a multiple of {FP8_BLOCK}, got {cfg.hidden}")


def check_routing(op: str, topk_idx, topk_weights, num_tokens: int, cfg: EPConfig) -> None:
    check_array(op, "topk_idx", topk_idx, (num_tokens, cfg.num_topk), (jnp.int32,))
    if topk_weights is not None:
        check_array(op, "topk_weights", topk_weights, (num_tokens, cfg.num_topk), (jnp.float32,))


def check_handle(op: str, handle, expected_type, shapes: dict) -> None:
    if not isinstance(handle, expected_type):
        raise EPError(f"jax_ep.{op}: handle must be a {expected_type.__name__} (the .handle of the matching "
                      f"dispatch output), got {type(handle).__name__}")
    for field, shape in shapes.items():
        check_array(op, f"handle.{field}", getattr(handle, field), shape, (jnp.int32,))
