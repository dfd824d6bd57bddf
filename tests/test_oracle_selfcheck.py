"""Checks of tests/oracle.py itself: hand-worked examples and closed forms (no jax involved)."""
import os

import numpy as np
import pytest

import oracle as O

BF16, FP8 = O.BF16, O.FP8


def _fresh_seed():
    env = os.environ.get("JAX_EP_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


def deepep_routing(rng, R, T, E, K):
    """DeepEP test routing: scores |N(0,1)| + 1 per expert, top-k without repeats."""
    scores = np.abs(rng.standard_normal((R, T, E))) + 1
    return np.argsort(-scores, axis=-1, kind="stable")[..., :K].astype(np.int32)


# --------------------------------------------------------------------------------------------------------
# A tiny example worked by hand: R=2, E=4 (L=2), T=3, K=2
#   rank 0: t0 [0, 1] -> rank 0      t1 [1, 2] -> ranks 0, 1    t2 [-1, 3] -> rank 1
#   rank 1: t0 [2, 2] -> rank 1      t1 [3, 0] -> ranks 0, 1    t2 [-1, 9] -> nowhere (9 >= E)
# --------------------------------------------------------------------------------------------------------
HAND_IDX = np.array([[[0, 1], [1, 2], [-1, 3]],
                     [[2, 2], [3, 0], [-1, 9]]], np.int32)
HAND_W = np.array([[[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]],
                   [[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]], np.float32)


def _hand_x(H=128):
    x = np.zeros((2, 3, H), np.float32)
    for s in range(2):
        for t in range(3):
            x[s, t] = 10 * s + t + 1           # row value names (s, t)
    return x.astype(BF16)


def test_sanitize():
    got = O.sanitize_topk(np.array([-1, 0, 3, 4, 7, -7, 2**31 - 1, -2**31], np.int64), 4)
    np.testing.assert_array_equal(got, [-1, 0, 3, -1, -1, -1, -1, -1])


def test_layout_hand():
    lay = O.layout(HAND_IDX, 4, 2)
    np.testing.assert_array_equal(lay["num_tokens_per_rank"], [[2, 2], [1, 2]])
    np.testing.assert_array_equal(lay["num_tokens_per_expert"], [[1, 2, 1, 1], [1, 0, 1, 1]])
    np.testing.assert_array_equal(lay["is_token_in_rank"],
                                  [[[1, 0], [1, 1], [0, 1]], [[0, 1], [1, 1], [0, 0]]])


def test_dispatch_hand_no_drop():
    x = _hand_x()
    out = O.dispatch(x, HAND_IDX, HAND_W, 4, 2, capacity=6)
    h = out["handle"]
    np.testing.assert_array_equal(out["num_recv_tokens"], [3, 4])
    # rank 0 rows: (0,0) (0,1) (1,1); rank 1 rows: (0,1) (0,2) (1,0) (1,1)
    np.testing.assert_array_equal(h["recv_src_rank"], [[0, 0, 1, -1, -1, -1], [0, 0, 1, 1, -1, -1]])
    np.testing.assert_array_equal(h["recv_src_idx"], [[0, 1, 1, -1, -1, -1], [1, 2, 0, 1, -1, -1]])
    np.testing.assert_array_equal(out["recv_x"][0, :, 0].astype(np.float32), [1, 2, 12, 0, 0, 0])
    np.testing.assert_array_equal(out["recv_x"][1, :, 0].astype(np.float32), [2, 3, 11, 12, 0, 0])
    assert (out["recv_x"][0, 3:].astype(np.float32) == 0).all()
    np.testing.assert_array_equal(out["recv_topk_idx"][0], [[0, 1], [1, -1], [-1, 0], [-1, -1], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(out["recv_topk_idx"][1], [[-1, 0], [-1, 1], [0, 0], [1, -1], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(out["recv_topk_weights"][0], [[.5, .25], [1, 0], [0, 8], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(out["recv_topk_weights"][1], [[0, 2], [0, 4], [5, 6], [7, 0], [0, 0], [0, 0]])
    # rank1 local expert 0 (= global 2): rows (0,1), (1,0) -> 2 (the repeated 2 in (1,0) counts once)
    np.testing.assert_array_equal(out["num_recv_tokens_per_expert"], [[2, 2], [2, 2]])
    np.testing.assert_array_equal(h["send_pos"], [[[0, -1], [1, 0], [-1, 1]], [[-1, 0], [0, 1], [-1, -1]]])
    np.testing.assert_array_equal(h["recv_rank_counts"], [[2, 1], [2, 2]])
    np.testing.assert_array_equal(h["send_row_offset"], [[0, 0], [2, 2]])


def test_dispatch_hand_capacity_and_combine():
    x = _hand_x()
    out = O.dispatch(x, HAND_IDX, HAND_W, 4, 2, capacity=2)
    h = out["handle"]
    np.testing.assert_array_equal(out["num_recv_tokens"], [3, 4])          # overflow is reported
    np.testing.assert_array_equal(out["num_recv_tokens_per_expert"], [[2, 2], [2, 2]])  # counts dropped rows
    np.testing.assert_array_equal(h["recv_src_rank"], [[0, 0], [0, 0]])
    np.testing.assert_array_equal(h["recv_src_idx"], [[0, 1], [1, 2]])
    y, _ = O.combine(out["recv_x"], h["send_pos"], h["send_row_offset"])
    yf = y[..., 0].astype(np.float32)
    # rank0 t0 kept on r0 -> 1; t1 kept on r0 and r1 -> 4; t2 kept on r1 -> 3.
    # rank1 t0 -> r1 row 2 (dropped) -> 0; t1 -> r0 row 2, r1 row 3 (both dropped) -> 0; t2 nowhere -> 0.
    np.testing.assert_array_equal(yf, [[1, 4, 3], [0, 0, 0]])


def test_combine_weights_hand():
    out = O.dispatch(_hand_x(), HAND_IDX, HAND_W, 4, 2, capacity=8)
    h = out["handle"]
    _, yw = O.combine(out["recv_x"], h["send_pos"], h["send_row_offset"], out["recv_topk_weights"])
    # each token's valid weights come back exactly once (each expert lives on exactly one rank)
    exp = np.where(O.sanitize_topk(HAND_IDX, 4) >= 0, HAND_W, 0)
    np.testing.assert_array_equal(yw, exp)


@pytest.mark.parametrize("seed", [0, 1, None])
@pytest.mark.parametrize("R,E,T,K,C", [(2, 4, 5, 2, None), (4, 8, 16, 4, None), (8, 16, 7, 3, 9),
                                       (4, 4, 16, 1, 5), (8, 8, 1, 4, None)])
def test_closed_forms(R, E, T, K, C, seed):
    seed = _fresh_seed() if seed is None else seed
    rng = np.random.default_rng(seed)
    msg = f"seed={seed} R={R} E={E} T={T} K={K} C={C}"
    H = 128
    C = R * T if C is None else C
    idx = deepep_routing(rng, R, T, E, K)
    # sprinkle invalid ids and repeats
    bad = rng.random((R, T, K)) < 0.2
    idx = np.where(bad, rng.choice(np.array([-1, E, E + 3, -7], np.int32), size=idx.shape), idx)
    rep = rng.random((R, T)) < 0.2
    idx[..., -1] = np.where(rep, idx[..., 0], idx[..., -1])
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    x = rng.integers(-8, 9, size=(R, T, H)).astype(BF16)
    out = O.dispatch(x, idx, w, E, R, C)
    lay, h = out["layout"], out["handle"]
    L = E // R
    n = out["num_recv_tokens"]
    # rows that arrive at r == sum over sources of their num_tokens_per_rank[.., r]
    np.testing.assert_array_equal(n, lay["num_tokens_per_rank"].sum(0), err_msg=msg)
    np.testing.assert_array_equal(h["recv_rank_counts"], lay["num_tokens_per_rank"].T, err_msg=msg)
    # per expert: sum over sources of num_tokens_per_expert for the rank's experts
    np.testing.assert_array_equal(out["num_recv_tokens_per_expert"],
                                  lay["num_tokens_per_expert"].sum(0).reshape(R, L), err_msg=msg)
    for r in range(R):
        k = min(int(n[r]), C)
        src = list(zip(h["recv_src_rank"][r, :k], h["recv_src_idx"][r, :k]))
        assert src == sorted(src) and len(set(src)) == k, msg            # sorted, unique
        assert (h["recv_src_rank"][r, k:] == -1).all() and (h["recv_src_idx"][r, k:] == -1).all(), msg
        assert (out["recv_x"][r, k:].astype(np.float32) == 0).all(), msg
        assert (out["recv_topk_idx"][r, k:] == -1).all() and (out["recv_topk_weights"][r, k:] == 0).all(), msg
        for i, (s, t) in enumerate(src):
            np.testing.assert_array_equal(out["recv_x"][r, i].astype(np.float32), x[s, t].astype(np.float32))
            assert h["send_row_offset"][s, r] + h["send_pos"][s, t, r] == i, msg
    # round trip: every kept copy of a token comes back once
    y, _, acc, _ = O.combine(out["recv_x"], h["send_pos"], h["send_row_offset"], accum=np.float64,
                             return_acc=True)
    kept = np.zeros((R, T))
    for s in range(R):
        for t in range(T):
            for r in range(R):
                p = h["send_pos"][s, t, r]
                kept[s, t] += (p >= 0) and (h["send_row_offset"][s, r] + p < C)
    np.testing.assert_array_equal(acc, x.astype(np.float64) * kept[..., None], err_msg=msg)
    if C >= R * T:
        np.testing.assert_array_equal(kept, lay["is_token_in_rank"].sum(-1), err_msg=msg)
    # send-side and receive-side combines agree
    acc2 = O.combine_from_recv_src(out["recv_x"], h["recv_src_rank"], h["recv_src_idx"], T)
    np.testing.assert_array_equal(acc, acc2, err_msg=msg)


def test_combine_accumulates_in_f32_not_bf16():
    # 256 + 1 + 1 is 258 in f32 but 256 if each partial sum were rounded to bf16 (8-bit mantissa)
    R, T, E, K = 3, 1, 3, 3
    idx = np.array([[[0, 1, 2]], [[-1, -1, -1]], [[-1, -1, -1]]], np.int32)
    x = np.zeros((R, T, 128), np.float32).astype(BF16)
    out = O.dispatch(x, idx, np.ones((R, T, K), np.float32), E, R, R * T)
    eo = np.zeros((R, R * T, 128), np.float32)
    eo[0, 0], eo[1, 0], eo[2, 0] = 256, 1, 1
    y, _ = O.combine(eo.astype(BF16), out["handle"]["send_pos"], out["handle"]["send_row_offset"])
    assert float(y[0, 0, 0]) == 258.0


# --------------------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------------------
def test_fp8_hand():
    x = np.zeros((1, 256), np.float32)
    x[0, 0] = 448.0                      # block 0: amax 448 -> scale exactly 1
    x[0, 1] = 1.0625                     # halfway 1.0 / 1.125 -> even (1.0)
    x[0, 2] = 1.1875                     # halfway 1.125 / 1.25 -> even (1.25)
    x[0, 3] = -1.0625
    x[0, 4] = 2.0 ** -10                 # half the smallest subnormal (2^-9) -> 0
    x[0, 5] = 3 * 2.0 ** -10             # 1.5 subnormal steps -> 2 steps (even)
    # block 1 all zeros
    q, sc = O.quantize_fp8(x.astype(BF16))
    np.testing.assert_array_equal(sc, [[1.0, 1.0]])
    np.testing.assert_array_equal(q[0, :6].astype(np.float32), [448, 1.0, 1.25, -1.0, 0, 2.0 ** -8])
    assert (q[0, 128:].astype(np.float32) == 0).all()
    # scale = amax * f32(1/448) for a generic block
    y = np.zeros((1, 128), np.float32)
    y[0, 7] = -3.0
    y[0, 8] = 1.5
    q, sc = O.quantize_fp8(y.astype(BF16))
    assert sc[0, 0] == np.float32(3.0) * np.float32(1.0 / 448.0)
    assert float(q[0, 7]) == -448.0 and float(q[0, 8]) == 224.0


@pytest.mark.parametrize("seed", [0, None])
def test_fp8_roundtrip_error_bound(seed):
    seed = _fresh_seed() if seed is None else seed
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((16, 384)) * rng.choice([1e-3, 1.0, 50.0], size=(16, 1))).astype(BF16)
    x[3, 128:256] = 0
    q, sc = O.quantize_fp8(x)
    assert np.isfinite(q.astype(np.float32)).all() and (np.abs(q.astype(np.float32)) <= 448).all()
    assert sc[3, 1] == 1.0  # a zero block
    dq = O.dequantize_fp8(q, sc)
    xf = x.astype(np.float32)
    # e4m3: 3 mantissa bits -> relative half-step 2^-4 for normals; subnormal step 2^-9 (times scale)
    bound = np.maximum(np.abs(xf) * 2.0 ** -4, np.repeat(sc, 128, axis=-1) * 2.0 ** -10) * 1.0001
    assert (np.abs(dq - xf) <= bound).all(), f"seed={seed}"
    # and the amax element of each non-zero block maps to +-448 exactly (the zero block: all 0)
    blk = np.abs(xf.reshape(16, 3, 128))
    am = blk.argmax(-1)
    qb = np.abs(q.astype(np.float32).reshape(16, 3, 128))
    above = blk.max(-1) > 0
    assert above.sum() == 16 * 3 - 1 and not above[3, 1]
    np.testing.assert_array_equal(np.take_along_axis(qb, am[..., None], -1)[..., 0][above], 448.0, err_msg=f"seed={seed}")
    assert (qb[3, 1] == 0).all()


def test_fp8_step_distance():
    a = np.array([1.0, 1.0, -0.0, 448.0, -2.0 ** -9], np.float32).astype(FP8)
    b = np.array([1.125, 1.25, 0.0, 416.0, 2.0 ** -9], np.float32).astype(FP8)
    np.testing.assert_array_equal(O.fp8_step_distance(a, b), [1, 2, 0, 1, 2])


# --------------------------------------------------------------------------------------------------------
# Low-latency mode
# --------------------------------------------------------------------------------------------------------
def test_low_latency_hand():
    x = _hand_x()
    d = O.low_latency_dispatch(x, HAND_IDX, 4, 2, 4, use_fp8=False)
    # expert 0 @ r0 l0: (0,0), (1,1); expert 1 @ r0 l1: (0,0), (0,1)
    # expert 2 @ r1 l0: (0,1), (1,0) [once despite repeat]; expert 3 @ r1 l1: (0,2), (1,1)
    np.testing.assert_array_equal(d["recv_count"], [[2, 2], [2, 2]])
    si = np.full((2, 2, 8), -1)
    si[0, 0, :2] = [0, 1]
    si[0, 1, :2] = [0, 1]
    si[1, 0, :2] = [1, 0]
    si[1, 1, :2] = [2, 1]
    np.testing.assert_array_equal(d["src_info"], si)
    np.testing.assert_array_equal(d["layout_range"], [[[1, 1], [2, 0]], [[1, 1], [1, 1]]])
    np.testing.assert_array_equal(d["recv_x"][1, 0, :2, 0].astype(np.float32), [2, 11])
    np.testing.assert_array_equal(d["recv_x"][0, 0, :2, 5].astype(np.float32), [1, 12])
    # combine: expert_out row value = 100*(global expert) + row
    eo = np.zeros((2, 2, 8, 128), np.float32)
    for r in range(2):
        for l in range(2):
            for i in range(8):
                eo[r, l, i] = 100 * (2 * r + l) + i
    y = O.low_latency_combine(eo.astype(BF16), HAND_IDX, HAND_W, d["src_info"], d["layout_range"], 4)
    yf = y[..., 0].astype(np.float32)
    exp = np.array([
        [0.5 * 0 + 0.25 * 100,          # r0 t0: e0 row0, e1 row0
         1.0 * 101 + 2.0 * 200,         # r0 t1: e1 row1, e2 row0
         4.0 * 300],                    # r0 t2: e3 row0
        [(5.0 + 6.0) * 201,             # r1 t0: e2 row1 twice
         7.0 * 301 + 8.0 * 1,           # r1 t1: e3 row1, e0 row1
         0.0]], np.float32)
    np.testing.assert_array_equal(yf, exp.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(O.low_latency_rows_from_handle(HAND_IDX, d["src_info"], d["layout_range"], 4),
                                  d["row_of"])


@pytest.mark.parametrize("seed", [0, None])
@pytest.mark.parametrize("R,E,T,Tm,K", [(2, 4, 3, 4, 2), (4, 8, 8, 8, 4), (8, 16, 1, 2, 1), (8, 8, 3, 3, 8)])
def test_low_latency_closed_forms(R, E, T, Tm, K, seed):
    seed = _fresh_seed() if seed is None else seed
    rng = np.random.default_rng(seed)
    msg = f"seed={seed} R={R} E={E} T={T} K={K}"
    H = 256
    L = E // R
    idx = deepep_routing(rng, R, T, E, K)
    bad = rng.random((R, T, K)) < 0.2
    idx = np.where(bad, rng.choice(np.array([-1, E, -7], np.int32), size=idx.shape), idx)
    if K > 1:
        idx[:, :, 1] = np.where(rng.random((R, T)) < 0.3, idx[:, :, 0], idx[:, :, 1])
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(BF16)
    for fp8 in (False, True):
        d = O.low_latency_dispatch(x, idx, E, R, Tm, use_fp8=fp8)
        # recv_count == sum over sources of num_tokens_per_expert (pairs deduped)
        lay = O.layout(idx, E, R)
        np.testing.assert_array_equal(d["recv_count"], lay["num_tokens_per_expert"].sum(0).reshape(R, L), msg)
        np.testing.assert_array_equal(d["layout_range"].sum(-1), d["recv_count"], msg)
        np.testing.assert_array_equal(d["layout_range"], lay["num_tokens_per_expert"].T.reshape(R, L, R), msg)
        for r in range(R):
            for l in range(L):
                n = d["recv_count"][r, l]
                assert (d["src_info"][r, l, n:] == -1).all(), msg
                assert (d["src_info"][r, l, :n] >= 0).all(), msg
        np.testing.assert_array_equal(O.low_latency_rows_from_handle(idx, d["src_info"], d["layout_range"], E),
                                      d["row_of"], msg)
        if not fp8:
            # round trip: combine(recv_x) = x * sum of valid weights (f32 exact here up to bf16 output rounding)
            y, acc = O.low_latency_combine(d["recv_x"], idx, w, d["src_info"], d["layout_range"], E, accum=np.float64,
                                  return_acc=True)
            wsum = np.where(O.sanitize_topk(idx, E) >= 0, w.astype(np.float64), 0).sum(-1)
            np.testing.assert_allclose(acc, x.astype(np.float64) * wsum[..., None], rtol=1e-12, atol=1e-12,
                                       err_msg=msg)
        else:
            q, sc = O.quantize_fp8(x)
            for (r, l), rows in d["rows"].items():
                for i, (s, t) in enumerate(rows):
                    assert d["recv_x"][r, l, i].view(np.uint8).tobytes() == q[s, t].view(np.uint8).tobytes()
                    np.testing.assert_array_equal(d["recv_x_scales"][r, l, i], sc[s, t])
