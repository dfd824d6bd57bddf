"""The Backend protocol: what the ops modules call after validation, inside shard_map over cfg.axis_name.

Every function takes the config and R = num_ranks (static). Results are the NamedTuples of jax_ep/types.py, filled
identically by every backend (docs/SPEC.md: dispatch outputs bit-identical, combine within f32 tolerance).
Low-latency functions take a LowLatencyState and return the next one (jax_ep/low_latency_chain.py); "buffers" are
backend-private arrays a split send hands to its receive.
"""

from __future__ import annotations

from typing import Optional, Protocol

import jax

from ..config import EPConfig
from ..types import DispatchHandle, DispatchLayout, DispatchOutput, LowLatencyDispatchOutput, LowLatencyHandle
from ..types import LowLatencyState

Array = jax.Array


class Backend(Protocol):
    # normal mode
    def layout(self, topk_idx: Array, cfg: EPConfig, num_ranks: int) -> DispatchLayout: ...

    def dispatch(self, x: Array, x_scales: Optional[Array], topk_idx: Array, topk_weights: Array, cfg: EPConfig,
                 num_ranks: int) -> DispatchOutput: ...

    def cached_dispatch(self, payload: Array, weights: Optional[Array], handle: DispatchHandle, cfg: EPConfig,
                        num_ranks: int) -> tuple[Array, Optional[Array]]: ...

    def combine(self, values: Array, weights: Optional[Array], handle: DispatchHandle, cfg: EPConfig,
                num_ranks: int) -> tuple[Array, Optional[Array]]: ...

    # low-latency mode
    def low_latency_dispatch(self, x: Array, topk_idx: Array, state: LowLatencyState, cfg: EPConfig, num_ranks: int,
                    use_fp8: bool) -> tuple[LowLatencyDispatchOutput, LowLatencyState]: ...

    def low_latency_dispatch_send(self, x: Array, topk_idx: Array, state: LowLatencyState, cfg: EPConfig, num_ranks: int,
                         use_fp8: bool) -> tuple[tuple, LowLatencyState]: ...

    def low_latency_dispatch_recv(self, buffers: tuple, state: LowLatencyState, cfg: EPConfig, num_ranks: int,
                         use_fp8: bool) -> tuple[LowLatencyDispatchOutput, LowLatencyState]: ...

    def low_latency_combine(self, expert_out: Array, topk_idx: Array, topk_weights: Array, handle: LowLatencyHandle,
                   state: LowLatencyState, cfg: EPConfig, num_ranks: int) -> tuple[Array, LowLatencyState]: ...

    def low_latency_combine_send(self, expert_out: Array, topk_idx: Array, topk_weights: Array, handle: LowLatencyHandle,
                        state: LowLatencyState, cfg: EPConfig, num_ranks: int) -> tuple[tuple, LowLatencyState]: ...

    def low_latency_combine_recv(self, buffers: tuple, state: LowLatencyState, cfg: EPConfig,
                        num_ranks: int) -> tuple[Array, LowLatencyState]: ...

    # gradients of the low-latency ops
    def low_latency_dispatch_transpose(self, cot_rows: Array, topk_idx: Array, handle: LowLatencyHandle, cfg: EPConfig,
                              num_ranks: int) -> Array: ...

    def low_latency_combine_transpose(self, dy: Array, expert_out: Array, topk_idx: Array, topk_weights: Array,
                             handle: LowLatencyHandle, cfg: EPConfig, num_ranks: int) -> tuple[Array, Array]: ...
