"""EPConfig: the static description of one expert-parallel exchange."""

from __future__ import annotations

import dataclasses

BACKENDS = ("auto", "cuda", "reference")

# Largest shapes the CUDA kernels are built for (docs/API.md); the reference backend has no such limits but the
# config is validated the same way everywhere so a program that runs on CPU also runs on the GPUs.
MAX_TOPK = 16
FP8_BLOCK = 128  # channels per fp8 scale
# low_latency_buffers=None allocates the low-latency buffers only for decode-sized configs (T_max up to this).
LOW_LATENCY_AUTO_MAX_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Static configuration of an EP exchange; frozen and hashable (usable as a jit static argument).

    Args:
      num_experts: E, experts across the EP group; must divide evenly by the group size R.
      hidden: H, channels per token row.
      num_topk: K, experts per token.
      max_tokens_per_rank: T_max, the most tokens any rank passes in one call.
      axis_name: the mesh axis that forms one EP group.
      recv_capacity: C, receive rows per rank in normal mode; None means R * T_max (never drops).
      num_max_nvl_peers: ranks per NVLink domain (DeepEP's NUM_MAX_NVL_PEERS); larger groups get an RDMA sub team.
      backend: "cuda", "reference" or "auto".
      num_sms: SMs the CUDA kernels may occupy (like DeepEP's Buffer.num_sms), leaving the rest for compute.
      timeout_seconds: a device wait for a peer gives up (with an error) after about this long.
      low_latency_buffers: allocate the low-latency mode's buffers for this config on the CUDA backend (like
        DeepEP's low_latency_mode). None (default) means "when max_tokens_per_rank <= 256" (decode-sized): they
        hold R * T_max rows per local expert, too much for prefill-sized T_max.
    """

    num_experts: int
    hidden: int
    num_topk: int
    max_tokens_per_rank: int
    axis_name: str = "ep"
    recv_capacity: int | None = None
    num_max_nvl_peers: int = 8
    backend: str = "auto"
    num_sms: int = 24
    timeout_seconds: float = 100.0
    low_latency_buffers: bool | None = None

    def __post_init__(self):
        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"EPConfig.{name} must be a positive int, got {value!r}")

        for name in ("num_experts", "hidden", "num_topk", "max_tokens_per_rank", "num_max_nvl_peers", "num_sms"):
            positive_int(name)
        if self.num_topk > MAX_TOPK:
            raise ValueError(f"EPConfig.num_topk must be in [1, {MAX_TOPK}], got {self.num_topk}")
        if self.num_topk > self.num_experts:
            raise ValueError(
                f"EPConfig.num_topk must be <= num_experts ({self.num_experts}), got {self.num_topk}")
        if self.recv_capacity is not None:
            positive_int("recv_capacity")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise ValueError(f"EPConfig.axis_name must be a non-empty str, got {self.axis_name!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"EPConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.low_latency_buffers not in (None, True, False):
            raise ValueError(f"EPConfig.low_latency_buffers must be None, True or False, got "
                             f"{self.low_latency_buffers!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"EPConfig.timeout_seconds must be > 0, got {self.timeout_seconds!r}")

    # ----- derived quantities (R is only known inside shard_map or from a mesh) -----
    def check_num_ranks(self, num_ranks: int) -> None:
        if self.num_experts % num_ranks != 0:
            raise ValueError(
                f"EPConfig.num_experts ({self.num_experts}) must be divisible by the size of mesh axis "
                f"'{self.axis_name}' ({num_ranks})")

    def num_local_experts(self, num_ranks: int) -> int:
        self.check_num_ranks(num_ranks)
        return self.num_experts // num_ranks

    def capacity(self, num_ranks: int) -> int:
        """C: normal-mode receive rows per rank."""
        if self.recv_capacity is None:
            return num_ranks * self.max_tokens_per_rank
        return self.recv_capacity

    def uses_low_latency_buffers(self) -> bool:
        """Whether the CUDA backend allocates low-latency buffers for this config (see low_latency_buffers)."""
        if self.low_latency_buffers is None:
            return self.max_tokens_per_rank <= LOW_LATENCY_AUTO_MAX_TOKENS
        return self.low_latency_buffers

    def low_latency_rows(self, num_ranks: int) -> int:
        """Rows per local expert in low-latency mode (R * T_max)."""
        return num_ranks * self.max_tokens_per_rank
