"""Independent NumPy oracle for jax_ep (written from docs/SPEC.md + docs/API.md only).

Everything here works on ALL ranks of one EP group at once: per-rank inputs are stacked on a leading
axis of size R (``x[s]`` is rank s's ``[T, H]`` input), and every output is stacked the same way
(``recv_x[r]`` is what rank r sees).  The code is deliberately loop-based and slow: it is meant to be
obviously correct, not fast.  Keep shapes small.

Conventions used below: ``s`` is a source rank, ``r`` a destination (receiving) rank, ``t`` a token
index on its source rank, ``L = E // R`` local experts, rank r owns global experts ``[r*L, (r+1)*L)``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(448.0)
QBLOCK = 128

__all__ = [
    "BF16", "FP8", "sanitize_topk", "layout", "dispatch", "combine", "combine_from_recv_src",
    "quantize_fp8", "dequantize_fp8", "fp8_step_distance", "low_latency_dispatch", "low_latency_combine",
]


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def sanitize_topk(topk_idx, num_experts):
    """Ids outside [0, E) are treated as -1.  Returns int64 (no overflow games with int32 extremes)."""
    idx = np.asarray(topk_idx).astype(np.int64)
    return np.where((idx >= 0) & (idx < num_experts), idx, -1)


def _check_group(arr, R, name):
    arr = np.asarray(arr)
    if arr.shape[0] != R:
        raise ValueError(f"{name}: leading axis must be R={R} (one entry per rank), got shape {arr.shape}")
    return arr


def _token_experts(idx_row):
    """Distinct valid global experts named by one token's top-k row (sorted)."""
    return sorted({int(e) for e in idx_row if e >= 0})


# ----------------------------------------------------------------------------------------------------------
# normal mode
# ----------------------------------------------------------------------------------------------------------
def layout(topk_idx, num_experts, num_ranks):
    """get_dispatch_layout for every rank.

    topk_idx: [R, T, K].  Returns dict with
      num_tokens_per_rank [R, R] i32   (rank s -> how many of its tokens go to rank r; once per rank)
      num_tokens_per_expert [R, E] i32 (once per expert even if repeated in top-k)
      is_token_in_rank [R, T, R] bool
    """
    R, E = num_ranks, num_experts
    if E % R:
        raise ValueError(f"E={E} not divisible by R={R}")
    L = E // R
    idx = sanitize_topk(_check_group(topk_idx, R, "topk_idx"), E)
    _, T, _ = idx.shape
    ntpr = np.zeros((R, R), np.int32)
    ntpe = np.zeros((R, E), np.int32)
    itr = np.zeros((R, T, R), bool)
    for s in range(R):
        for t in range(T):
            for e in _token_experts(idx[s, t]):
                ntpe[s, e] += 1
                itr[s, t, e // L] = True
        ntpr[s] = itr[s].sum(axis=0)
    return dict(num_tokens_per_rank=ntpr, num_tokens_per_expert=ntpe, is_token_in_rank=itr)


def _recv_rows(is_token_in_rank, r):
    """Row list (before the capacity cut) of destination rank r: (src rank, token) in the spec'd order."""
    R, T, _ = is_token_in_rank.shape
    return [(s, t) for s in range(R) for t in range(T) if is_token_in_rank[s, t, r]]


def _local_topk(idx_row, r, L):
    """recv_topk_idx entry for one row at rank r: local id where the expert lives on r, else -1."""
    return np.array([(e - r * L) if (e >= 0 and e // L == r) else -1 for e in idx_row], np.int64)


def dispatch(x, topk_idx, topk_weights, num_experts, num_ranks, capacity, x_scales=None):
    """Normal-mode dispatch for every rank.

    x [R, T, H] (bf16, or float8_e4m3fn with x_scales [R, T, H//128] f32), topk_idx [R, T, K],
    topk_weights [R, T, K] f32, capacity C (rows per receiving rank).
    Returns dict with the DispatchOutput fields (stacked per rank) plus ``handle`` (dict of the
    DispatchHandle fields) plus ``rows`` (per rank: full row list (s, t) before the cut, for messages).
    """
    R, E, C = num_ranks, num_experts, int(capacity)
    L = E // R
    x = _check_group(x, R, "x")
    _, T, H = x.shape
    idx = sanitize_topk(_check_group(topk_idx, R, "topk_idx"), E)
    K = idx.shape[2]
    w = np.asarray(_check_group(topk_weights, R, "topk_weights"), np.float32)
    lay = layout(idx, E, R)
    itr = lay["is_token_in_rank"]

    send_pos = np.full((R, T, R), -1, np.int32)
    for s in range(R):
        for r in range(R):
            pos = 0
            for t in range(T):
                if itr[s, t, r]:
                    send_pos[s, t, r] = pos
                    pos += 1
    recv_rank_counts = np.zeros((R, R), np.int32)        # [receiver r, source s]
    for r in range(R):
        for s in range(R):
            recv_rank_counts[r, s] = int(itr[s, :, r].sum())
    send_row_offset = np.zeros((R, R), np.int32)         # [sender s, receiver r]
    for s in range(R):
        for r in range(R):
            send_row_offset[s, r] = int(recv_rank_counts[r, :s].sum())

    recv_x = np.zeros((R, C, H), x.dtype)
    recv_x_scales = None
    if x_scales is not None:
        xs = np.asarray(_check_group(x_scales, R, "x_scales"), np.float32)
        recv_x_scales = np.zeros((R, C, xs.shape[2]), np.float32)
    recv_topk_idx = np.full((R, C, K), -1, np.int32)
    recv_topk_weights = np.zeros((R, C, K), np.float32)
    recv_src_idx = np.full((R, C), -1, np.int32)
    recv_src_rank = np.full((R, C), -1, np.int32)
    num_recv_tokens = np.zeros((R,), np.int32)
    num_recv_tokens_per_expert = np.zeros((R, L), np.int32)
    all_rows = []
    for r in range(R):
        rows = _recv_rows(itr, r)
        all_rows.append(rows)
        num_recv_tokens[r] = len(rows)
        for i, (s, t) in enumerate(rows):
            loc = _local_topk(idx[s, t], r, L)
            for l in sorted({int(v) for v in loc if v >= 0}):   # once per local expert per row
                num_recv_tokens_per_expert[r, l] += 1
            # handle consistency: the row is the s-th block's send_pos-th entry
            assert i == send_row_offset[s, r] + send_pos[s, t, r]
            if i >= C:
                continue                                      # dropped (last rows in row order)
            recv_x[r, i] = x[s, t]
            if recv_x_scales is not None:
                recv_x_scales[r, i] = xs[s, t]
            recv_topk_idx[r, i] = loc
            recv_topk_weights[r, i] = np.where(loc >= 0, w[s, t], np.float32(0))
            recv_src_idx[r, i] = t
            recv_src_rank[r, i] = s
    handle = dict(send_pos=send_pos, recv_src_idx=recv_src_idx, recv_src_rank=recv_src_rank,
                  recv_rank_counts=recv_rank_counts, send_row_offset=send_row_offset)
    return dict(recv_x=recv_x, recv_x_scales=recv_x_scales, recv_topk_idx=recv_topk_idx,
                recv_topk_weights=recv_topk_weights, num_recv_tokens=num_recv_tokens,
                num_recv_tokens_per_expert=num_recv_tokens_per_expert, handle=handle, layout=lay,
                rows=all_rows)


def combine(expert_out, send_pos, send_row_offset, topk_weights_recv=None, accum=np.float32,
            out_dtype=None, return_acc=False):
    """Normal-mode combine for every rank, driven by the handle's send side only.

    expert_out [R, C, W]; send_pos [R, T, R]; send_row_offset [R, R] (sender, receiver).
    y[s, t] = sum over receivers r (ascending) with row = send_row_offset[s, r] + send_pos[s, t, r] < C of
    expert_out[r, row], accumulated in ``accum``, cast to ``out_dtype`` (default expert_out.dtype).
    topk_weights_recv [R, C, K] -> y_weights [R, T, K] f32, same routes.
    Returns (y, y_weights) (y_weights None if not given); with return_acc also the unrounded accumulators.
    """
    expert_out = np.asarray(expert_out)
    send_pos = np.asarray(send_pos)
    send_row_offset = np.asarray(send_row_offset)
    R, C, W = expert_out.shape
    T = send_pos.shape[1]
    out_dtype = expert_out.dtype if out_dtype is None else np.dtype(out_dtype)
    acc = np.zeros((R, T, W), accum)
    accw = None
    if topk_weights_recv is not None:
        twr = np.asarray(topk_weights_recv, np.float32)
        accw = np.zeros((R, T, twr.shape[2]), accum)
    for s in range(R):
        for t in range(T):
            for r in range(R):
                p = int(send_pos[s, t, r])
                if p < 0:
                    continue
                row = int(send_row_offset[s, r]) + p
                if row >= C:
                    continue
                acc[s, t] += expert_out[r, row].astype(accum)
                if accw is not None:
                    accw[s, t] += twr[r, row].astype(accum)
    y = acc.astype(np.float32).astype(out_dtype) if out_dtype != np.dtype(accum) else acc.copy()
    yw = None if accw is None else accw.astype(np.float32)
    if return_acc:
        return y, yw, acc, accw
    return y, yw


def combine_from_recv_src(expert_out, recv_src_rank, recv_src_idx, num_tokens, accum=np.float64):
    """Same sum as ``combine`` but driven by the receive side (recv_src_rank/idx); used to cross-check."""
    expert_out = np.asarray(expert_out)
    R, C, W = expert_out.shape
    acc = np.zeros((R, num_tokens, W), accum)
    for r in range(R):
        for i in range(C):
            s, t = int(recv_src_rank[r, i]), int(recv_src_idx[r, i])
            if s < 0:
                assert t < 0
                continue
            acc[s, t] += expert_out[r, i].astype(accum)
    return acc


# ----------------------------------------------------------------------------------------------------------
# FP8 (docs/API.md rule)
# ----------------------------------------------------------------------------------------------------------
def quantize_fp8(x):
    """Per token per 128 channels: |x| < 2^-126 counts as +-0; amax over the finite channels in f32, scale =
    amax * f32(1/448), q = e4m3fn(x * (1/scale)) (IEEE f32 division, RNE); amax < 448 * 2^-126 (zero or tiny block)
    -> scale 1, q 0; a non-finite channel becomes the NaN code 0x7F.
    x [..., H] -> (q [..., H] float8_e4m3fn, scale [..., H//128] f32)."""
    x = np.asarray(x)
    H = x.shape[-1]
    if H % QBLOCK:
        raise ValueError(f"H={H} not a multiple of {QBLOCK}")
    xf = x.astype(np.float32).reshape(x.shape[:-1] + (H // QBLOCK, QBLOCK))
    xf = np.where(np.abs(xf) < np.float32(2.0 ** -126), np.copysign(np.float32(0.0), xf), xf)  # subnormals: +-0
    finite = np.isfinite(xf)
    xf = np.where(finite, xf, np.float32(0.0))
    amax = np.abs(xf).max(axis=-1)                                   # f32
    nz = amax >= np.float32(448.0 * 2.0 ** -126)                     # below: the scale would be subnormal
    scale = np.where(nz, amax * np.float32(1.0 / FP8_MAX), np.float32(1.0)).astype(np.float32)
    inverse = (np.float32(1.0) / scale).astype(np.float32)           # IEEE f32 division
    ratio = np.where(nz[..., None], (xf * inverse[..., None]).astype(np.float32), xf)  # scale 1: tiny -> +-0
    q = ratio.astype(FP8)                                            # ml_dtypes: round to nearest even
    q = np.where(finite, q.view(np.uint8), np.uint8(0x7F)).view(FP8)
    return q.reshape(x.shape), scale


def dequantize_fp8(q, scale):
    q = np.asarray(q)
    H = q.shape[-1]
    qf = q.astype(np.float32).reshape(q.shape[:-1] + (H // QBLOCK, QBLOCK))
    return (qf * np.asarray(scale, np.float32)[..., None]).reshape(q.shape)


def _fp8_ordinal(q):
    """Monotone integer position of each e4m3fn value (+0 and -0 both map to 0)."""
    b = np.asarray(q).astype(FP8).view(np.uint8).astype(np.int32)
    mag = b & 0x7F
    return np.where(b & 0x80, -mag, mag)


def fp8_step_distance(a, b):
    """How many representable e4m3fn steps apart a and b are (elementwise)."""
    return np.abs(_fp8_ordinal(a) - _fp8_ordinal(b))


# ----------------------------------------------------------------------------------------------------------
# low-latency mode
# ----------------------------------------------------------------------------------------------------------
def low_latency_dispatch(x, topk_idx, num_experts, num_ranks, max_tokens_per_rank, use_fp8):
    """Low-latency dispatch for every rank.

    x [R, T, H] bf16, topk_idx [R, T, K].  Returns dict with
      recv_x [R, L, R*T_max, H] (fp8 or bf16; rows >= recv_count are 0 here but unspecified in the spec)
      recv_x_scales [R, L, R*T_max, H//128] f32 or None
      recv_count [R, L] i32
      src_info [R, L, R*T_max] i32 (-1 on invalid rows), layout_range [R, L, R] i32
      row_of [R(src), T, K] i64: row (within expert idx's buffer on rank idx//L) for each valid (t, k), -1 else
      rows: per (r, l) the list of (s, t) in row order
    """
    R, E, Tm = num_ranks, num_experts, int(max_tokens_per_rank)
    L = E // R
    N = R * Tm
    x = _check_group(x, R, "x")
    _, T, H = x.shape
    if T > Tm:
        raise ValueError(f"T={T} > T_max={Tm}")
    idx = sanitize_topk(_check_group(topk_idx, R, "topk_idx"), E)
    K = idx.shape[2]
    if use_fp8:
        q, sc = quantize_fp8(x)
        payload = q
        recv_x = np.zeros((R, L, N, H), FP8)
        recv_x_scales = np.zeros((R, L, N, H // QBLOCK), np.float32)
    else:
        payload = np.asarray(x).astype(BF16)
        recv_x = np.zeros((R, L, N, H), BF16)
        recv_x_scales = None
    recv_count = np.zeros((R, L), np.int32)
    src_info = np.full((R, L, N), -1, np.int32)
    layout_range = np.zeros((R, L, R), np.int32)
    row_of = np.full((R, T, K), -1, np.int64)
    rows = {}
    for r in range(R):
        for l in range(L):
            e = r * L + l
            lst = []
            for s in range(R):
                for t in range(T):
                    if e in _token_experts(idx[s, t]):          # once per (token, expert) pair
                        i = len(lst)
                        lst.append((s, t))
                        recv_x[r, l, i] = payload[s, t]
                        if use_fp8:
                            recv_x_scales[r, l, i] = sc[s, t]
                        src_info[r, l, i] = t
                        layout_range[r, l, s] += 1
                        for k in range(K):
                            if idx[s, t, k] == e:
                                row_of[s, t, k] = i
            assert len(lst) <= N
            recv_count[r, l] = len(lst)
            rows[(r, l)] = lst
    return dict(recv_x=recv_x, recv_x_scales=recv_x_scales, recv_count=recv_count, src_info=src_info,
                layout_range=layout_range, row_of=row_of, rows=rows)


def low_latency_message_tables(topk_idx, num_experts, num_ranks, max_tokens_per_rank):
    """per_rank mode's handle tables for every rank, from the routing alone (loops, no cumsum tricks).

    Returns msg_token [R(receiver), R(src), T_max] and token_rows [R, R, T_max, K]: message j from s is the j-th
    token t of s (in token order) with at least one expert on the receiver; token_rows holds l * R*T_max + (row of
    (s, t) in the receiver's expert l) for each k whose expert is local, -1 elsewhere and for j >= messages.
    """
    R, E, Tm = num_ranks, num_experts, int(max_tokens_per_rank)
    L, N = E // R, R * Tm
    idx = sanitize_topk(np.asarray(topk_idx), E)
    _, T, K = idx.shape
    row_of = low_latency_dispatch(np.zeros((R, T, 128), BF16), idx, E, R, Tm, use_fp8=False)["row_of"]
    msg_token = np.full((R, R, Tm), -1, np.int32)
    token_rows = np.full((R, R, Tm, K), -1, np.int32)
    for r in range(R):
        for s in range(R):
            j = 0
            for t in range(T):
                local = [k for k in range(K) if idx[s, t, k] >= 0 and idx[s, t, k] // L == r]
                if not local:
                    continue
                msg_token[r, s, j] = t
                for k in local:
                    token_rows[r, s, j, k] = (idx[s, t, k] % L) * N + row_of[s, t, k]
                j += 1
    return msg_token, token_rows


def low_latency_rows_from_handle(topk_idx, src_info, layout_range, num_experts):
    """Recover each valid (s, t, k)'s row from the LL handle alone (src_info + layout_range).
    Raises AssertionError when the handle does not name exactly one row for a pair."""
    src_info = np.asarray(src_info)
    layout_range = np.asarray(layout_range)
    R, L, _ = src_info.shape
    idx = sanitize_topk(topk_idx, num_experts)
    _, T, K = idx.shape
    row_of = np.full((R, T, K), -1, np.int64)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(idx[s, t, k])
                if e < 0:
                    continue
                r, l = divmod(e, L)
                start = int(layout_range[r, l, :s].sum())
                cnt = int(layout_range[r, l, s])
                hits = np.nonzero(src_info[r, l, start:start + cnt] == t)[0]
                assert hits.size == 1, (f"handle names {hits.size} rows for (src {s}, token {t}, expert {e}) "
                                        f"in block [{start}, {start + cnt})")
                row_of[s, t, k] = start + int(hits[0])
    return row_of


def low_latency_combine(expert_out, topk_idx, topk_weights, src_info, layout_range, num_experts, accum=np.float32,
               return_acc=False):
    """Low-latency combine for every rank.

    expert_out [R, L, R*T_max, H] bf16, topk_idx/topk_weights [R, T, K], handle (src_info, layout_range).
    y[s, t] = sum_k (valid k, k ascending) w[s,t,k] * expert_out[e//L, e%L, row(s,t,e)], in ``accum``,
    returned as bf16 (plus the accumulator with return_acc).
    """
    expert_out = np.asarray(expert_out)
    R, L, N, H = expert_out.shape
    idx = sanitize_topk(topk_idx, num_experts)
    w = np.asarray(topk_weights, np.float32)
    _, T, K = idx.shape
    row_of = low_latency_rows_from_handle(idx, src_info, layout_range, num_experts)
    acc = np.zeros((R, T, H), accum)
    for s in range(R):
        for t in range(T):
            for k in range(K):
                e = int(idx[s, t, k])
                if e < 0:
                    continue
                r, l = divmod(e, L)
                val = expert_out[r, l, row_of[s, t, k]].astype(accum)
                acc[s, t] += (accum(w[s, t, k]) * val).astype(accum)
    y = acc.astype(np.float32).astype(BF16)
    if return_acc:
        return y, acc
    return y
