"""Trace-time argument checks (SPEC §6): each failure names the argument and the expected value.

Also the one place where the CUDA kernels' limits (jax_ep/config.py) are checked for every backend, and where a
handle or a pending object is checked against the config of the op that consumes it (docs/API.md, "Errors and
edge cases").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..config import (FP8_BLOCK, HIDDEN_MULTIPLE, MAX_GROUP_RANKS, MAX_LOW_LATENCY_EXPERTS, MAX_NORMAL_EXPERTS,
                     MAX_NVL_PEERS, ROW_ALIGN_BYTES, EPConfig)


from ..errors import EPError, EPTypeError  # noqa: F401  (re-exported: validation is where callers look)
from ..types import DispatchHandle, LowLatencyHandle


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


_SAME_EVERYWHERE = "checked on every backend, so that a program that runs here also runs on the GPUs"


def check_kernel_limits(op: str, cfg: EPConfig, num_ranks: int, low_latency: bool) -> None:
    """The CUDA kernels' limits (config.py, equal to cuda/include/jax_ep/constants.h), on every backend.

    R <= MAX_GROUP_RANKS, and R <= MAX_NVL_PEERS for normal mode on the NVLink kernels (R <= num_max_nvl_peers);
    E <= MAX_NORMAL_EXPERTS (normal mode) or MAX_LOW_LATENCY_EXPERTS (low-latency mode);
    H % 8 == 0 (16-byte bf16 rows). K <= MAX_TOPK is checked by EPConfig itself; fp8's H % 128 by check_fp8_hidden.
    """
    if num_ranks > MAX_GROUP_RANKS:
        raise EPError(f"jax_ep.{op}: mesh axis cfg.axis_name={cfg.axis_name!r} has {num_ranks} ranks; an EP group "
                      f"has at most {MAX_GROUP_RANKS} (kMaxGroupRanks of the CUDA kernels; {_SAME_EVERYWHERE})")
    if not low_latency and num_ranks > MAX_NVL_PEERS and not cfg.normal_over_nvshmem(num_ranks):
        raise EPError(f"jax_ep.{op}: a normal-mode group of {num_ranks} ranks with cfg.num_max_nvl_peers="
                      f"{cfg.num_max_nvl_peers} would run the NVLink kernels, which take at most {MAX_NVL_PEERS} "
                      f"ranks (kMaxNvlPeers); set num_max_nvl_peers <= {MAX_NVL_PEERS} (the GPUs per host) so that "
                      f"it runs the NVSHMEM kernels ({_SAME_EVERYWHERE})")
    limit, name, mode = ((MAX_LOW_LATENCY_EXPERTS, "kMaxLowLatencyExperts", "low-latency") if low_latency else
                         (MAX_NORMAL_EXPERTS, "kMaxLayoutExperts", "normal"))
    if cfg.num_experts > limit:
        raise EPError(f"jax_ep.{op}: cfg.num_experts={cfg.num_experts} exceeds {limit}, the most experts of "
                      f"{mode} mode ({name} of the CUDA kernels; {_SAME_EVERYWHERE})")
    if cfg.hidden % HIDDEN_MULTIPLE != 0:
        raise EPError(f"jax_ep.{op}: cfg.hidden={cfg.hidden} must be a multiple of {HIDDEN_MULTIPLE}: the kernels "
                      f"move rows as {ROW_ALIGN_BYTES}-byte vectors, so a bf16 row of 2 * hidden bytes must be a "
                      f"multiple of {ROW_ALIGN_BYTES} bytes ({_SAME_EVERYWHERE})")


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


# ---- handles and pending objects against the consuming op's config ---------------------------------------------
_SAME_CONFIG = "combine with the EPConfig of the dispatch that made the handle"


def check_dispatch_handle(op: str, handle, cfg: EPConfig, num_ranks: int) -> int:
    """A normal-mode DispatchHandle against the config of the combine (or cached dispatch) that consumes it.

    What its shapes fix: send_pos [T, R] (T = the dispatch's tokens per rank, R = its group size), recv_src_idx /
    recv_src_rank [C] (its receive capacity), recv_rank_counts / send_row_offset [R]. The rule: same R, the same
    capacity C = cfg.capacity(R), and T <= cfg.max_tokens_per_rank (the combine returns y [T, H] and stages T
    tokens per source rank; with a smaller T_max it would silently alias rows). Returns T.
    """
    fields = ("send_pos", "recv_src_idx", "recv_src_rank", "recv_rank_counts", "send_row_offset")
    ranks = {"send_pos": 2, "recv_src_idx": 1, "recv_src_rank": 1, "recv_rank_counts": 1, "send_row_offset": 1}
    check_handle(op, handle, DispatchHandle, {f: (None,) * ranks[f] for f in fields})
    num_tokens, handle_ranks = handle.send_pos.shape
    if handle_ranks != num_ranks:
        raise EPError(f"jax_ep.{op}: handle.send_pos has shape {tuple(handle.send_pos.shape)}: the handle comes from "
                      f"a dispatch over {handle_ranks} ranks, but mesh axis cfg.axis_name={cfg.axis_name!r} has "
                      f"{num_ranks} here")
    for f in ("recv_rank_counts", "send_row_offset"):
        check_array(op, f"handle.{f}", getattr(handle, f), (num_ranks,), (jnp.int32,))
    capacity = cfg.capacity(num_ranks)
    handle_capacity = handle.recv_src_idx.shape[0]
    if handle_capacity != capacity:
        how = (f"cfg.recv_capacity={cfg.recv_capacity}" if cfg.recv_capacity is not None else
               f"cfg.recv_capacity=None: R * cfg.max_tokens_per_rank = {num_ranks} * {cfg.max_tokens_per_rank}")
        raise EPError(f"jax_ep.{op}: handle.recv_src_idx has {handle_capacity} rows (the receive capacity of the "
                      f"dispatch that made the handle), but this cfg's capacity is {capacity} ({how}); {_SAME_CONFIG}")
    check_array(op, "handle.recv_src_rank", handle.recv_src_rank, (capacity,), (jnp.int32,))
    if not 1 <= num_tokens <= cfg.max_tokens_per_rank:
        raise EPError(f"jax_ep.{op}: handle.send_pos has shape {tuple(handle.send_pos.shape)}: its dispatch had "
                      f"T={num_tokens} tokens per rank, more than cfg.max_tokens_per_rank={cfg.max_tokens_per_rank} "
                      f"here (y would be [T, H] = [{num_tokens}, {cfg.hidden}] with rows staged for only "
                      f"{cfg.max_tokens_per_rank} tokens); {_SAME_CONFIG}")
    return num_tokens


def check_low_latency_handle(op: str, handle, cfg: EPConfig, num_ranks: int) -> None:
    """A LowLatencyHandle against the config of the LL combine: src_info [L, R*T_max] and layout_range [L, R] fix
    L = E / R and T_max of the dispatch; both must equal this cfg's."""
    check_handle(op, handle, LowLatencyHandle, {"src_info": (None, None), "layout_range": (None, None)})
    num_local, rows = cfg.num_local_experts(num_ranks), cfg.low_latency_rows(num_ranks)
    h_local, h_rows = handle.src_info.shape
    if (h_local, h_rows) != (num_local, rows):
        made_by = (f"a low_latency_dispatch with num_experts={h_local * num_ranks}, max_tokens_per_rank="
                   f"{h_rows // num_ranks}" if h_rows % num_ranks == 0 else "a low_latency_dispatch of another config")
        raise EPError(f"jax_ep.{op}: handle.src_info has shape {(h_local, h_rows)} = [L, R*T_max], made by "
                      f"{made_by} on {num_ranks} ranks; this cfg (num_experts={cfg.num_experts}, max_tokens_per_rank="
                      f"{cfg.max_tokens_per_rank}) expects {(num_local, rows)}; {_SAME_CONFIG}")
    check_array(op, "handle.layout_range", handle.layout_range, (num_local, num_ranks), (jnp.int32,))
    if cfg.low_latency_mode_for(num_ranks) == "per_rank":
        if handle.msg_token is None or handle.token_rows is None:
            raise EPError(f"jax_ep.{op}: cfg uses low_latency_mode 'per_rank' on {num_ranks} ranks (low_latency_mode="
                          f"{cfg.low_latency_mode!r}) but the handle has no msg_token / token_rows: it was made by a "
                          f"per_expert low_latency_dispatch; {_SAME_CONFIG}")
        check_array(op, "handle.msg_token", handle.msg_token, (num_ranks, cfg.max_tokens_per_rank), (jnp.int32,))
        check_array(op, "handle.token_rows", handle.token_rows, (num_ranks, cfg.max_tokens_per_rank, cfg.num_topk),
                    (jnp.int32,))


def check_pending_config(op: str, pending_cfg, cfg: EPConfig, producer: str) -> None:
    """The receive half of a split LL op must use the EPConfig its send used (the buffers' layout depends on it).
    Names every differing field with both values."""
    if pending_cfg is None or pending_cfg == cfg:
        return
    diffs = [f"{f.name}={getattr(cfg, f.name)!r} here but {getattr(pending_cfg, f.name)!r} at the send"
             for f in dataclasses.fields(EPConfig) if getattr(cfg, f.name) != getattr(pending_cfg, f.name)]
    raise EPError(f"jax_ep.{op}: cfg differs from the EPConfig of the {producer} that made this pending ("
                  f"{'; '.join(diffs)}); pass the same cfg to both halves")
