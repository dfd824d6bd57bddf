"""EPConfig: the static description of one expert-parallel exchange, and the limits every backend validates."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .errors import EPError

BACKENDS = ("auto", "cuda", "reference")
LOW_LATENCY_MODES = ("auto", "per_expert", "per_rank")
# low_latency_mode="auto" picks per_rank when it moves at most this fraction of per_expert's rows and the call passes
# at least PER_RANK_MIN_TOKENS tokens (see EPConfig.low_latency_mode_for).
PER_RANK_MAX_ROW_FRACTION = 2.0 / 3.0
PER_RANK_MIN_TOKENS = 64

# ---- limits of the CUDA kernels (docs/API.md, "Errors and edge cases") ------------------------------------------
# Every backend validates them at trace time (jax_ep/ops/validation.py: check_kernel_limits), so a program that runs on
# the reference backend (CPU) also runs on the GPUs. Each number is the C++ constant of the same name in
# cuda/include/jax_ep/constants.h; tests/test_bad_inputs.py parses that header and checks they are equal.
MAX_TOPK = 16                   # kMaxTopk: K, experts per token
MAX_GROUP_RANKS = 256           # kMaxGroupRanks: R, ranks per EP group (per-rank header words, rank masks)
MAX_NVL_PEERS = 8               # kMaxNvlPeers: R of a normal-mode group on the NVLink kernels (R <= num_max_nvl_peers)
MAX_NORMAL_EXPERTS = 8192       # kMaxLayoutExperts: E in normal mode (per-expert counters in shared memory)
MAX_LOW_LATENCY_EXPERTS = 1024  # kMaxLowLatencyExperts: E in low-latency mode (per-expert counters, shared arrays)
FP8_BLOCK = 128                 # kFp8Block: channels per fp8 scale; fp8 needs H % FP8_BLOCK == 0
# Rows move as 16-byte vectors: a bf16 row (2 * H bytes) must be a multiple of 16 bytes, so H % 8 == 0. The C++
# side checks the literal (xla_ffi/normal_ffi.cc `row_bytes % 16 == 0`, xla_ffi/op_state.cc `hidden % 8`).
ROW_ALIGN_BYTES = 16
HIDDEN_MULTIPLE = ROW_ALIGN_BYTES // 2  # bf16

# low_latency_buffers=None allocates the low-latency buffers only for decode-sized configs (T_max up to this).
LOW_LATENCY_AUTO_MAX_TOKENS = 256
# timeout_seconds goes to the kernels as int64 nanoseconds.
MAX_TIMEOUT_SECONDS = 9.0e9

_INT_FIELDS = ("num_experts", "hidden", "num_topk", "max_tokens_per_rank", "num_max_nvl_peers", "num_sms")


def _is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (np.bool_ is not an np.integer)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Static configuration of an EP exchange; frozen and hashable (usable as a jit static argument).

    Integer fields accept Python or NumPy integers and timeout_seconds any real number (NumPy scalars included); they
    are stored as Python int / float, so a config built from NumPy values equals (and hashes like) the Python one.
    Invalid values raise jax_ep.EPError (a ValueError) naming the field.

    Args:
      num_experts: E, experts across the EP group; must divide evenly by the group size R.
      hidden: H, channels per token row.
      num_topk: K, experts per token (1 <= K <= 16 and K <= E).
      max_tokens_per_rank: T_max, the most tokens any rank passes in one call.
      axis_name: the mesh axis that forms one EP group.
      recv_capacity: C, receive rows per rank in normal mode; None means R * T_max (never drops).
      num_max_nvl_peers: ranks per NVLink domain (DeepEP's NUM_MAX_NVL_PEERS); larger groups get an RDMA sub team.
      backend: "cuda", "reference" or "auto".
      num_sms: SMs the CUDA kernels may occupy (like DeepEP's Buffer.num_sms), leaving the rest for compute.
      timeout_seconds: a device wait for a peer gives up (with an error) after about this long.
      low_latency_mode: how low-latency ops move rows (docs/API.md, "Low-latency modes"). "per_expert" (DeepEP's
        layout): one copy per (token, expert), weighted sum at the source. "per_rank": one copy per (token,
        destination rank), expanded into the local expert slots on arrival; the combine reduces each rank's experts
        there and sends one row per (token, rank) back. Same dispatch outputs (bit-identical); the combine differs
        only in rounding (docs/SPEC.md). "auto" (default): chosen per call, per_rank when the call passes T >= 64
        tokens and per_rank moves at most 2/3 of per_expert's rows for uniform routing, else per_expert
        (low_latency_mode_for; always per_expert on the NVSHMEM kernels, see below). Both modes are timed in docs/BENCHMARKS.md.
      low_latency_buffers: allocate the low-latency mode's buffers for this config on the CUDA backend (like
        DeepEP's low_latency_mode). None (default) means "when max_tokens_per_rank <= 256" (decode-sized): they
        hold R * T_max rows per local expert, too much for prefill-sized T_max.
      allow_nvlink_for_low_latency: like DeepEP's allow_nvlink_for_low_latency_mode. A group of R ranks with
        R <= num_max_nvl_peers and this True (default) runs the NVLink kernels: rows move by stores through peer
        pointers. A group that spans NVLink domains (R > num_max_nvl_peers: several hosts, or simulated nodes on
        one) or this False runs the NVSHMEM kernels of jax_ep._jax_ep_nvshmem (the RDMA leg of
        docs/INTERNODE.md): rows to ranks of the same NVLink domain (r // num_max_nvl_peers) move by stores through
        NVSHMEM's peer pointer when this is True, all others by NVSHMEM put-with-signal. Those kernels need one
        process per GPU (python -m jax_ep.launch, or JAX_EP_TRANSPORT=nvshmem with one process) and
        low_latency_mode "per_expert" ("auto" resolves to it). Every config of one mesh axis must agree. The
        reference backend gives the same results either way.
    """

    num_experts: int
    hidden: int
    num_topk: int
    max_tokens_per_rank: int
    axis_name: str = "ep"
    recv_capacity: Optional[int] = None
    num_max_nvl_peers: int = 8
    backend: str = "auto"
    num_sms: int = 24
    timeout_seconds: float = 100.0
    low_latency_buffers: Optional[bool] = None
    low_latency_mode: str = "auto"
    allow_nvlink_for_low_latency: bool = True

    def __post_init__(self):
        def normalize(name, value):
            object.__setattr__(self, name, value)

        def positive_int(name):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise EPError(f"EPConfig.{name} must be a positive int, got {value!r} ({type(value).__name__})")
            normalize(name, int(value))

        for name in _INT_FIELDS:
            positive_int(name)
        if self.recv_capacity is not None:
            positive_int("recv_capacity")
        if self.num_topk > MAX_TOPK:
            raise EPError(f"EPConfig.num_topk must be in [1, {MAX_TOPK}] (the CUDA kernels' kMaxTopk), got "
                          f"{self.num_topk}")
        if self.num_topk > self.num_experts:
            raise EPError(f"EPConfig.num_topk must be <= num_experts ({self.num_experts}), got {self.num_topk}")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise EPError(f"EPConfig.axis_name must be a non-empty str, got {self.axis_name!r}")
        normalize("axis_name", str(self.axis_name))
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise EPError(f"EPConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        normalize("backend", str(self.backend))
        if not isinstance(self.low_latency_mode, str) or self.low_latency_mode not in LOW_LATENCY_MODES:
            raise EPError(f"EPConfig.low_latency_mode must be one of {LOW_LATENCY_MODES}, got "
                          f"{self.low_latency_mode!r}")
        normalize("low_latency_mode", str(self.low_latency_mode))
        llb = self.low_latency_buffers
        if llb is not None and not isinstance(llb, (bool, np.bool_)):
            raise EPError(f"EPConfig.low_latency_buffers must be None, True or False, got {llb!r}")
        normalize("low_latency_buffers", None if llb is None else bool(llb))
        nv = self.allow_nvlink_for_low_latency
        if not isinstance(nv, (bool, np.bool_)):
            raise EPError(f"EPConfig.allow_nvlink_for_low_latency must be True or False, got {nv!r}")
        normalize("allow_nvlink_for_low_latency", bool(nv))
        if not self.allow_nvlink_for_low_latency and self.low_latency_mode == "per_rank":
            raise EPError("EPConfig.allow_nvlink_for_low_latency=False needs low_latency_mode 'per_expert' or 'auto' "
                          "(the NVSHMEM low-latency kernels are per_expert only), got low_latency_mode='per_rank'")
        t = self.timeout_seconds
        if (isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, float, np.integer, np.floating))
                or not math.isfinite(float(t)) or not 0 < float(t) <= MAX_TIMEOUT_SECONDS):
            raise EPError(f"EPConfig.timeout_seconds must be a number > 0 (finite, at most {MAX_TIMEOUT_SECONDS:g} "
                          f"seconds), got {t!r} ({type(t).__name__})")
        normalize("timeout_seconds", float(t))

    # ----- derived quantities (R is only known inside shard_map or from a mesh) -----
    def check_num_ranks(self, num_ranks: int) -> None:
        """EPError unless num_ranks (R) divides num_experts."""
        if self.num_experts % num_ranks != 0:
            raise EPError(
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

    def low_latency_mode_for(self, num_ranks: int, num_tokens: Optional[int] = None) -> str:
        """'per_expert' or 'per_rank': low_latency_mode, with "auto" resolved for a call of `num_tokens` tokens per
        rank on `num_ranks` ranks (None: a call of max_tokens_per_rank tokens).

        A token sends K rows in per_expert mode (one per distinct expert) and one row per distinct destination rank
        in per_rank mode: for K experts drawn uniformly from R ranks, R * (1 - (1 - 1/R)^K) on average. per_rank
        has more fixed steps per op (the receiver expands messages, the combine pushes the weights first), so it
        wins only once there are enough rows: "auto" picks per_rank when the call passes T >= PER_RANK_MIN_TOKENS
        (64) tokens and the rows are at most PER_RANK_MAX_ROW_FRACTION (2/3) of K: e.g. R=2, K=8 (1/4 of the
        rows), R=8, K=8 (0.66); not for K=1 (no saving) or R=2, K=2 (3/4). E does not change the ratio (only
        L = E / R, the receiver's fan-out). T is a static shape, and a combine has its dispatch's T, so both ops of
        one layer resolve alike; one config serves 1-token steps in per_expert mode and 128-token steps in per_rank
        mode. The same on every backend, so both backends compute the same combine.
        """
        if self.low_latency_mode != "auto":
            return self.low_latency_mode
        tokens = self.max_tokens_per_rank if num_tokens is None else num_tokens
        if self.low_latency_over_nvshmem(num_ranks) or tokens < PER_RANK_MIN_TOKENS:
            return "per_expert"  # the NVSHMEM kernels' one mode; per_rank's fixed steps outweigh its rows
        k = self.num_topk
        per_rank_rows = num_ranks * (1.0 - (1.0 - 1.0 / num_ranks) ** k)
        return "per_rank" if per_rank_rows <= PER_RANK_MAX_ROW_FRACTION * k else "per_expert"

    def for_low_latency_call(self, num_ranks: int, num_tokens: int) -> "EPConfig":
        """This config with low_latency_mode resolved for one call (itself unless the mode is "auto"): what the
        backends run."""
        if self.low_latency_mode != "auto":
            return self
        return dataclasses.replace(self, low_latency_mode=self.low_latency_mode_for(num_ranks, num_tokens))

    def low_latency_over_nvshmem(self, num_ranks: int) -> bool:
        """Whether low-latency ops of a group of `num_ranks` run the NVSHMEM kernels (docs/INTERNODE.md): when
        allow_nvlink_for_low_latency=False, or when the group spans more than one NVLink domain
        (num_ranks > num_max_nvl_peers). Otherwise the NVLink kernels (stores through peer pointers) run."""
        return not self.allow_nvlink_for_low_latency or num_ranks > self.num_max_nvl_peers

    def normal_over_nvshmem(self, num_ranks: int) -> bool:
        """Whether normal-mode ops (dispatch, cached dispatch, combine) of a group of `num_ranks` run the NVSHMEM
        kernels (docs/INTERNODE.md): when the group spans more than one NVLink domain (num_ranks > num_max_nvl_peers).
        Then ranks r and q with r // num_max_nvl_peers == q // num_max_nvl_peers keep the NVLink stores, every other
        pair moves rows with NVSHMEM puts and signal ops (see normal_dispatch_forwarded for how many copies of a
        token cross between domains). Needs one process per GPU."""
        return num_ranks > self.num_max_nvl_peers

    def normal_dispatch_forwarded(self, num_ranks: int) -> bool:
        """Whether normal-mode dispatch (and cached dispatch) of a group of `num_ranks` is hierarchical, as DeepEP's
        internode kernels: a token crosses to each destination node (num_max_nvl_peers ranks) once, to the rank of
        that node with its own local index, which forwards it over NVLink to the node's destination ranks. Holds for
        groups over NVSHMEM (normal_over_nvshmem) with nodes of 2 to 8 ranks that divide num_ranks; with nodes of one
        rank a destination rank is a destination node, and otherwise every (token, destination rank) pair crosses.
        The kernels also need every rank of a node mapped (one host). When it holds, combine is node-first: the
        forwarder sums its node's rows in f32 and sends one partial row (values' dtype) per (token, node) back, so
        combine results are within f32-accumulation tolerance of the flat kernels' rather than bit-identical
        (docs/INTERNODE.md)."""
        nvl = self.num_max_nvl_peers
        return self.normal_over_nvshmem(num_ranks) and 2 <= nvl <= MAX_NVL_PEERS and num_ranks % nvl == 0

    def low_latency_nvl_domain(self) -> int:
        """Ranks per NVLink domain as the NVSHMEM low-latency kernels use it: ranks r and q with r // d == q // d
        move rows by stores through NVSHMEM's peer pointer (DeepEP's NVLink peers of the low-latency mode), the others
        by NVSHMEM puts and signal ops. 1 (only the rank itself) when allow_nvlink_for_low_latency=False."""
        return self.num_max_nvl_peers if self.allow_nvlink_for_low_latency else 1

    def low_latency_rows(self, num_ranks: int) -> int:
        """Rows per local expert in low-latency mode (R * T_max)."""
        return num_ranks * self.max_tokens_per_rank
