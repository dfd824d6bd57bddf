#!/usr/bin/env python3
"""Cost model for jax_ep's internode dispatch/combine (docs/INTERNODE.md section 3). Pure Python, stdlib only.

    python3 docs/internode_model.py                  # the tables of docs/INTERNODE.md
    python3 docs/internode_model.py --nic-gbs 25     # e.g. two GPUs sharing one 400 Gb/s NIC

Model (per rank, one call, uniform routing: each token picks K distinct experts uniformly among E; experts are
placed contiguously, E/R per rank, E/N per node; R = N * P ranks, P = num_max_nvl_peers):
    hit(G)        = 1 - C(E - G, K) / C(E, K)      probability that a token uses at least one of G given experts
    normal mode   RDMA rows/token   = (N - 1) * hit(E/N)        one row per remote destination node
                  NVLink rows/token = R * hit(E/R) * (P - 1)/P  one row per destination rank, minus the rank that
                                                                received it over RDMA (same local index)
    low latency   RDMA rows/token   = K * (1 - 1/N)             one row per (token, expert) on another node
                  NVLink rows/token = K * (1/N - 1/R)           same node, other GPU (direct pointers)
    time bound    = max(T * RDMA bytes / NIC, T * NVLink bytes / NVLink)   (the two legs overlap)
Row bytes: bf16 2H; fp8 H + 4H/128 (one f32 scale per 128 values); dispatch rows also carry 8K bytes of top-k ids
and weights (normal) or a 16-byte header (low latency, as DeepEP's test counts); combine rows are bf16 payload.
"Expected" times scale the bound by efficiencies, and add fixed costs, fitted to DeepEP V1's published H800 + CX7
numbers (printed below with the fit), so they say what a DeepEP-class implementation reaches, not a measurement.
"""

from __future__ import annotations

import argparse
import random
from math import comb

# ---------------------------------------------------------------------------------------------------------
# DeepEP V1 published internode numbers: H800 (~160 GB/s NVLink), one CX7 400 Gb/s (~50 GB/s) per GPU, 8 GPUs per
# node. deepseek-ai/DeepEP docs/legacy.md at dd758ca (the V1 README tables). Normal mode: T=4096, H=7168, E=256,
# K=8, top-4 node groups (tests/legacy/test_internode.py: num_topk_groups = min(num_nodes, 4)), FP8 dispatch, BF16
# combine, "bottleneck bandwidth" in GB/s = rows counted per destination node INCLUDING the sender's own node
# (test_internode.py: num_rdma_token_sent) * H * bytes / time. Low latency: T=128, H=7168, K=8, FP8 dispatch / BF16
# combine, time in us; EP8-64 re-measured with NVLink for same-node experts (README commit de8cfca, DeepEP PR #173),
# EP128/256 from the first release (every copy through the NIC).
# ---------------------------------------------------------------------------------------------------------
DEEPEP_NORMAL = {16: (43, 43), 32: (58, 57), 64: (51, 50)}  # EP -> (dispatch GB/s, combine GB/s)
DEEPEP_LL = {16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}  # EP -> (us, us)
DEEPEP_LL_NVLINK = {16, 32, 64}  # rows measured with NVLink for same-node experts
DEEPEP_NVL_GBS, DEEPEP_NIC_GBS = 160.0, 50.0


def hit(E: int, G: int, K: int) -> float:
    """P(a token's K distinct uniformly drawn experts include at least one of G given experts)."""
    return 1.0 - comb(E - G, K) / comb(E, K)


def row_bytes(H: int, K: int, kind: str) -> float:
    return {"bf16": 2 * H + 8 * K, "fp8": H + 4 * H / 128 + 8 * K, "combine": 2 * H + 4 * K,
            "ll_fp8": H + 4 * H / 128 + 16, "ll_bf16": 2 * H}[kind]


def normal_rows(R: int, P: int, E: int, K: int) -> dict:
    N = R // P
    return {"nodes": N * hit(E, E // N, K), "rdma": (N - 1) * hit(E, E // N, K),
            "ranks": R * hit(E, E // R, K), "nvl": R * hit(E, E // R, K) * (P - 1) / P,
            "per_expert_rdma": K * (1 - 1 / N)}


def ll_rows(R: int, P: int, E: int, K: int) -> dict:
    N = R // P
    return {"rdma": K * (1 - 1 / N), "nvl": K * (1 / N - 1 / R), "node_dedup_rdma": (N - 1) * hit(E, E // N, K)}


def deepep_routing_rows(R: int, P: int, E: int, K: int, tokens: int, seed: int, limit: int = 4) -> tuple[float, float]:
    """(distinct nodes, distinct ranks) per token under DeepEP's test routing: scores |N(0,1)|+1, top-min(N, limit)
    node groups by their best score, top-K experts inside them. Unrestricted (= uniform, exact) when N <= limit."""
    N = R // P
    groups = min(N, limit)
    if groups == N:
        return N * hit(E, E // N, K), R * hit(E, E // R, K)
    rng, per_node, per_rank = random.Random(seed), E // N, E // R
    nodes = ranks = 0
    for _ in range(tokens):
        s = [abs(rng.gauss(0.0, 1.0)) + 1.0 for _ in range(E)]
        best = sorted(range(N), key=lambda n: -max(s[n * per_node:(n + 1) * per_node]))[:groups]
        cand = [e for n in best for e in range(n * per_node, (n + 1) * per_node)]
        top = sorted(cand, key=lambda e: -s[e])[:K]
        nodes += len({e // per_node for e in top})
        ranks += len({e // per_rank for e in top})
    return nodes / tokens, ranks / tokens


def fit_line(xs, ys):
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nic-gbs", type=float, default=50.0, help="NIC bandwidth per GPU, GB/s (400 Gb/s = 50)")
    ap.add_argument("--nvl-gbs", type=float, default=350.0, help="NVLink all-to-all egress per GPU, GB/s")
    ap.add_argument("--peers", type=int, default=8, help="num_max_nvl_peers P (GPUs per NVLink domain)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256, help="E for normal mode (and LL where it divides R)")
    ap.add_argument("--ll-experts", type=int, default=288, help="E for LL mode where R divides it, else --experts")
    ap.add_argument("--tokens", type=int, default=4096, help="T for normal mode")
    ap.add_argument("--ll-tokens", type=int, default=128, help="T for low-latency mode")
    ap.add_argument("--mc-tokens", type=int, default=4096, help="tokens of the DeepEP-routing Monte Carlo")
    ap.add_argument("--node-limit", type=int, default=0,
                    help="normal mode: tokens use at most this many nodes (DeepSeek-V3 group-limited routing, M=4), "
                         "as DeepEP's tests route (Monte Carlo); 0 = uniform routing (default)")
    a = ap.parse_args()
    H, K, P, E, T, TL = a.hidden, a.topk, a.peers, a.experts, a.tokens, a.ll_tokens
    NIC, NVL = a.nic_gbs * 1e9, a.nvl_gbs * 1e9
    eps = [16, 32, 64, 128, 256]
    us = 1e6

    # ---- calibration against DeepEP V1 (H800 NVLink 160 GB/s, CX7 50 GB/s) -------------------------------------
    cal_rows, eff_nic, eff_nvl = [], [], []
    for R, (bw_d, bw_c) in DEEPEP_NORMAL.items():
        nodes, ranks = deepep_routing_rows(R, 8, 256, 8, a.mc_tokens, seed=R)
        N = R // 8
        # DeepEP counts payload bytes only (FP8: H * (1 + 4/128); BF16: 2H), per destination node incl. its own
        for op, bw, rb in (("dispatch FP8", bw_d, 7168 * (1 + 4 / 128)), ("combine BF16", bw_c, 2 * 7168)):
            t_pub = 4096 * nodes * rb / (bw * 1e9)
            t_nic = 4096 * nodes * (1 - 1 / N) * rb / (DEEPEP_NIC_GBS * 1e9)
            t_nvl = 4096 * ranks * 7 / 8 * rb / (DEEPEP_NVL_GBS * 1e9)
            bound = max(t_nic, t_nvl)
            (eff_nic if t_nic >= t_nvl else eff_nvl).append(bound / t_pub)
            cal_rows.append([f"EP{R}", op, f"{nodes:.2f}", f"{bw}", f"{t_pub * us:.0f}", f"{t_nic * us:.0f}",
                             f"{t_nvl * us:.0f}", f"{t_pub / bound:.2f}",
                             f"{4096 * nodes * (1 - 1 / N) * rb / t_pub / 1e9:.1f}"])
    print("## DeepEP V1 normal mode, published (H800, CX7; T=4096 H=7168 E=256 K=8, top-4 node groups) vs the model\n")
    print(table(["EP", "op", "nodes/token", "published GB/s", "published us", "model NIC us", "model NVLink us",
                 "published / bound", "NIC GB/s achieved"], cal_rows))
    eta_nic = sum(eff_nic) / len(eff_nic)
    eta_nvl = sum(eff_nvl) / len(eff_nvl) if eff_nvl else 1.0
    print(f"\nefficiency vs the bound: NIC-bound rows {eta_nic:.2f}, NVLink-bound rows {eta_nvl:.2f} "
          f"(used for 'expected' below)\n")

    ll_fit = {}
    for i, (name, kind) in enumerate((("dispatch FP8", "ll_fp8"), ("combine BF16", "ll_bf16"))):
        xs, ys = [], []
        for R, t in DEEPEP_LL.items():
            copies = 8 * (1 - 1 / (R // 8)) if R in DEEPEP_LL_NVLINK else 8 * (1 - 1 / R)
            xs.append(128 * copies * row_bytes(7168, 8, kind))
            ys.append(t[i] / us)
        t0, per_byte = fit_line(xs, ys)
        worst = max(abs(t0 + per_byte * x - y) / y for x, y in zip(xs, ys))
        ll_fit[kind] = (t0, min(1.0, 1 / per_byte / (DEEPEP_NIC_GBS * 1e9)))  # fixed cost, NIC efficiency
        print(f"DeepEP V1 LL {name}: published time = {t0 * us:.1f} us + NIC bytes / {1 / per_byte / 1e9:.2f} GB/s "
              f"(least squares over EP16-256, worst residual {worst * 100:.1f}%)")
    print()

    # ---- normal mode ------------------------------------------------------------------------------------------
    rows_t, rows_b = [], []
    skipped = [R for R in eps if E % R or R % P]
    for R in (R for R in eps if R not in skipped):
        N = R // P
        r = normal_rows(R, P, E, K)
        if a.node_limit and N > a.node_limit:
            nodes, ranks = deepep_routing_rows(R, P, E, K, a.mc_tokens, seed=R, limit=a.node_limit)
            r.update(nodes=nodes, rdma=nodes * (1 - 1 / N), ranks=ranks, nvl=ranks * (P - 1) / P)
        kib = {kind: (r["rdma"] * row_bytes(H, K, kind) / 1024, r["nvl"] * row_bytes(H, K, kind) / 1024)
               for kind in ("bf16", "fp8")}
        rows_b.append([f"EP{R}", N, f"{r['nodes']:.2f}", f"{r['rdma']:.2f}", f"{r['per_expert_rdma']:.2f}",
                       f"{r['ranks']:.2f}", f"{r['nvl']:.2f}", "%.1f / %.1f" % kib["bf16"], "%.1f / %.1f" % kib["fp8"]])
        cells = [f"EP{R}"]
        for kind in ("bf16", "fp8", "combine"):
            rb = row_bytes(H, K, kind)
            t_nic, t_nvl = T * r["rdma"] * rb / NIC, T * r["nvl"] * rb / NVL
            exp = max(t_nic / eta_nic, t_nvl / eta_nvl)
            cells.append(f"{t_nic * us:.0f} / {t_nvl * us:.0f} / **{exp * us:.0f}**")
        rows_t.append(cells)
    routing = f"at most {a.node_limit} nodes per token" if a.node_limit else "uniform routing"
    print(f"## Normal mode, per token (E={E}, K={K}, P={P}, H={H}, {routing}; KiB = 1024 bytes)\n")
    print(table(["EP", "nodes N", "dest. nodes/token", "RDMA rows/token", "RDMA rows without node dedup",
                 "dest. ranks/token", "NVLink rows/token", "KiB/token RDMA / NVLink, BF16",
                 "KiB/token RDMA / NVLink, FP8"], rows_b))
    print(f"\n## Normal mode, T={T} per rank: NIC bound / NVLink bound / expected, us "
          f"(NIC {a.nic_gbs:g} GB/s, NVLink {a.nvl_gbs:g} GB/s per GPU)\n")
    print(table(["EP", "dispatch BF16", "dispatch FP8", "combine BF16"], rows_t))
    if skipped:
        print(f"\n(skipped EP{', EP'.join(map(str, skipped))}: E={E} experts or P={P} do not divide evenly)")

    # ---- low-latency mode --------------------------------------------------------------------------------------
    rows_l = []
    for R in (R for R in eps if R % P == 0):
        El = a.ll_experts if a.ll_experts % R == 0 else E
        r = ll_rows(R, P, El, K)
        cells = [f"EP{R}", El, f"{r['rdma']:.2f}", f"{r['nvl']:.2f}", f"{r['node_dedup_rdma']:.2f}"]
        for kind in ("ll_fp8", "ll_bf16"):
            rb = row_bytes(H, K, kind)
            t_nic, t_nvl = TL * r["rdma"] * rb / NIC, TL * r["nvl"] * rb / NVL
            t0, eff = ll_fit[kind]
            exp = t0 + t_nic / eff
            cells.append(f"{t_nic * us:.0f} / {t_nvl * us:.0f} / **{max(exp, t_nvl) * us:.0f}**")
        rows_l.append(cells)
    print(f"\n## Low-latency mode, per-expert puts, T={TL} per rank: NIC bound / NVLink bound / expected, us\n")
    print(table(["EP", "E", "RDMA rows/token", "NVLink rows/token", "RDMA rows if node-deduplicated",
                 "dispatch FP8", "combine BF16"], rows_l))
    print("\nexpected (LL) = max(DeepEP-fitted fixed cost + NIC bound / fitted NIC efficiency, NVLink bound); "
          "expected (normal) = max(NIC bound / NIC efficiency, NVLink bound / NVLink efficiency)")


if __name__ == "__main__":
    main()
