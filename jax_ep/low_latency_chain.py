"""The low-latency state machine: how a LowLatencyState changes across LL ops (both backends, bit for bit).

Why a state at all: on the CUDA backend every LL op of an EP group shares one device epoch counter and two buffer
halves, so the LL ops must run on every rank in the order the program wrote them, and at most two sends may wait for
their receives (a third would wait for a receive queued behind it: a deadlock). XLA orders custom calls only by data
dependencies, so the order is carried as data: each op takes the state and returns the next one (aliased in place
on the CUDA backend). That holds under nested jit, scan, cond, remat, vjp and export with no trace-time bookkeeping.

state [4] i32 = [seq, in_flight, error, 0]
  send   (dispatch_send, combine_send): in_flight >= 2 -> error |= CHAIN_OVERSUBSCRIBED; else seq += 1,
         in_flight += 1
  recv   (dispatch_recv, combine_recv): in_flight -= 1 (not below 0)
  fused  (dispatch, combine): in_flight >= 2 -> error |= CHAIN_OVERSUBSCRIBED; else seq += 1
  The error word is sticky. On the CUDA backend a send or fused op whose output error is not 0 does no work (its
  outputs are unspecified), and a receive works exactly when its own send worked, so the device recovers.
The CUDA kernels apply exactly these rules to the same words (cuda/kernels/low_latency_kernels.cu) and add one device-side
check the reference backend cannot have: DEVICE_OVERSUBSCRIBED when the device already has two LL ops in flight
(a state was used twice, or LL ops of independent chains were reordered), instead of deadlocking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .errors import EPError
from .types import LowLatencyState

SEQ, IN_FLIGHT, ERROR = 0, 1, 2
CHAIN_OVERSUBSCRIBED = 1
DEVICE_OVERSUBSCRIBED = 2
MAX_IN_FLIGHT = 2

_MESSAGES = {
    CHAIN_OVERSUBSCRIBED: "a low-latency op started while two sends of this chain were still waiting for their "
                          "receives (at most two may be in flight: low_latency_*_send ... low_latency_*_recv)",
    DEVICE_OVERSUBSCRIBED: "the device already had two low-latency ops in flight when another one started: the "
                           "program used one LowLatencyState twice, or ran low-latency ops on independent chains "
                           "(thread one state through all of them)",
}


def initial(cfg=None) -> LowLatencyState:
    """A fresh state: [0, 0, 0, 0], varying over every manual mesh axis in scope (so scan carries keep one type)."""
    value = jnp.zeros((4,), jnp.int32)
    axes = _manual_axes()
    if axes:
        value = jax.lax.pcast(value, tuple(sorted(axes)), to="varying")
    return LowLatencyState(value)


def _manual_axes() -> frozenset:
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


def _update(value, ok, seq_delta, in_flight_delta):
    seq = jnp.where(ok, value[SEQ] + seq_delta, value[SEQ])
    in_flight = jnp.where(ok, jnp.maximum(value[IN_FLIGHT] + in_flight_delta, 0), value[IN_FLIGHT])
    error = value[ERROR] | jnp.where(ok, 0, CHAIN_OVERSUBSCRIBED).astype(jnp.int32)
    return jnp.stack([seq, in_flight, error, value[3]]).astype(jnp.int32)


def after_send(state: LowLatencyState) -> LowLatencyState:
    v = state.value
    return LowLatencyState(_update(v, v[IN_FLIGHT] < MAX_IN_FLIGHT, 1, 1))


def after_recv(state: LowLatencyState) -> LowLatencyState:
    v = state.value
    return LowLatencyState(_update(v, jnp.bool_(True), 0, -1))


def after_fused(state: LowLatencyState) -> LowLatencyState:
    v = state.value
    return LowLatencyState(_update(v, v[IN_FLIGHT] < MAX_IN_FLIGHT, 1, 0))


def describe(error: int) -> str:
    parts = [msg for bit, msg in _MESSAGES.items() if error & bit]
    unknown = error & ~sum(_MESSAGES)
    if unknown:
        parts.append(f"unknown error bits {unknown:#x}")
    return "; ".join(parts)


def check(state) -> None:
    """Raises EPError if any rank's state carries an error (host side: reads the state back from the devices).

    state: a LowLatencyState (or its value) as returned from shard_map, e.g. with out_specs P(axis): the values of
    all ranks side by side ([R * 4]); a single rank's [4] works too. In a job of several processes the global array
    is not fully addressable: each process checks the ranks whose shards it holds (call it on every process).
    """
    value = state.value if isinstance(state, LowLatencyState) else state
    rows = {}  # rank -> its 4 words
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        for shard in value.addressable_shards:
            start = shard.index[0].start or 0 if shard.index else 0
            words = np.asarray(shard.data).reshape(-1, 4)
            for i, w in enumerate(words):
                rows[start // 4 + i] = w
    else:
        rows = dict(enumerate(np.asarray(jax.device_get(value)).reshape(-1, 4)))
    bad = {rank: int(w[ERROR]) for rank, w in sorted(rows.items()) if int(w[ERROR]) != 0}
    if bad:
        errors = sorted(set(bad.values()))
        raise EPError("jax_ep: a low-latency op reported a misordered program on rank(s) "
                      f"{sorted(bad)}: " + "; ".join(describe(e) for e in errors) +
                      ". Ops after it did no work and their outputs are unspecified.")
