"""Child program of tests/test_internode_reference.py::test_groups_of_16_to_128_ranks: runs on 128 emulated CPU
devices (the parent sets XLA_FLAGS before this imports jax). For R = 16, 32, 64 and 128 ranks (kMaxGroupRanks is
256) on the reference backend, with H=128, K=4, T=4 and E=2R, 10% of the top-k slots masked:
  - against the independent oracle (tests/oracle.py), bit for bit: normal-mode dispatch (counts, rows, recv_topk_idx,
    recv_topk_weights, num_recv_tokens_per_expert) and combine (y, y_weights); low-latency dispatch (recv_count, the
    valid rows, the handle's src_info and layout_range, and in per_rank mode its msg_token and token_rows tables);
    low-latency combine within f32-accumulation tolerance (per_rank rounds each rank's partial sum to bf16);
  - every split into nodes (num_max_nvl_peers 1, 4, 8: nodes of 1, 4 and 8 ranks) gives byte-identical outputs of
    dispatch, combine and the low-latency ops, in both EPConfig.low_latency_mode values ("per_expert", "per_rank";
    the CUDA backend has no per_rank kernels over NVSHMEM, so there this is the contract alone);
  - a normal-mode group wider than 8 ranks on the NVLink kernels (num_max_nvl_peers = R) is an EPError naming
    kMaxNvlPeers, while the low-latency ops accept it and give the same bytes.
Cost (2 CPU cores): compiling dominates, about 20 s of the ~30 s that R=128 takes. The reference backend lowers the
same program for every split (num_max_nvl_peers does not enter its computation), so a persistent compilation cache in
a temporary directory lets the splits share one compile: every split is still traced, run and compared, and a split
whose program differed would compile its own. Prints `OK R=... rows=... (seconds)` lines.
"""
import _child  # noqa: F401 - the repository and tests/ (oracle, helpers) on sys.path

import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
import oracle  # noqa: E402
from helpers import random_topk  # noqa: E402

H, K, T = 128, 4, 4
GROUP_SIZES = (16, 32, 64, 128)
SPLITS = (1, 4, 8)  # num_max_nvl_peers: R > nvl for every R here, so every split is a group over "NVSHMEM"
MODES = ("per_expert", "per_rank")


def sharded(body, mesh):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))


def normal_program(cfg, mesh):
    def body(x, idx, w):
        out = jax_ep.dispatch(x, idx, w, cfg)
        y, yw = jax_ep.combine(out.recv_x, out.handle, cfg, topk_weights=out.recv_topk_weights)
        return (out.recv_x, out.recv_topk_idx, out.recv_topk_weights, out.num_recv_tokens[None],
                out.num_recv_tokens_per_expert, y, yw)

    return sharded(body, mesh)


def low_latency_program(cfg, mesh):
    def body(x, idx, w):
        ll = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        y = jax_ep.low_latency_combine(ll.recv_x, idx, w, ll.handle, cfg)
        outs = (ll.recv_x, ll.recv_count, ll.handle.src_info, ll.handle.layout_range, y)
        if cfg.low_latency_mode == "per_rank":
            outs += (ll.handle.msg_token, ll.handle.token_rows)
        return outs

    return sharded(body, mesh)


def run(program, args):
    return [np.asarray(a) for a in program(*args)]


def same_bytes(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i, a.dtype, a.shape, b.dtype, b.shape)
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8),
                                      err_msg=f"{what}: output {i}")


def expect_error(fn, *names):
    try:
        fn()
    except jax_ep.EPError as e:
        assert all(n in str(e) for n in names), (names, str(e))
        return
    raise AssertionError(f"no EPError naming {names}")


def check_normal(R, E, x, idx, w, got):
    recv_x, recv_idx, recv_w, n, n_per_expert, y, yw = got
    C, L = R * T, E // R
    want = oracle.dispatch(x, idx, w, E, R, C)
    np.testing.assert_array_equal(n.reshape(R), want["num_recv_tokens"], err_msg=f"R={R} num_recv_tokens")
    np.testing.assert_array_equal(n_per_expert.reshape(R, L), want["num_recv_tokens_per_expert"],
                                  err_msg=f"R={R} num_recv_tokens_per_expert")
    # C = R * T: nothing is dropped, and every row (padding included) is specified
    np.testing.assert_array_equal(recv_x.reshape(R, C, H).view(np.uint16), want["recv_x"].view(np.uint16),
                                  err_msg=f"R={R} recv_x")
    np.testing.assert_array_equal(recv_idx.reshape(R, C, K), want["recv_topk_idx"], err_msg=f"R={R} recv_topk_idx")
    np.testing.assert_array_equal(recv_w.reshape(R, C, K), want["recv_topk_weights"],
                                  err_msg=f"R={R} recv_topk_weights")
    # combine of the received rows: each token's copies are equal bf16 values, so the f32 sum is exact in any order
    y_want, yw_want = oracle.combine(want["recv_x"], want["handle"]["send_pos"], want["handle"]["send_row_offset"],
                                     want["recv_topk_weights"])
    np.testing.assert_array_equal(y.reshape(R, T, H).view(np.uint16), y_want.view(np.uint16), err_msg=f"R={R} y")
    np.testing.assert_array_equal(yw.reshape(R, T, K), yw_want, err_msg=f"R={R} y_weights")
    return int(n.sum())


def check_low_latency(R, E, x, idx, w, got, mode):
    recv_x, recv_count, src_info, layout_range, y = got[:5]
    L, N = E // R, R * T
    want = oracle.low_latency_dispatch(x, idx, E, R, T, use_fp8=False)
    ctx = f"R={R} {mode}"
    np.testing.assert_array_equal(recv_count.reshape(R, L), want["recv_count"], err_msg=f"{ctx} recv_count")
    np.testing.assert_array_equal(src_info.reshape(R, L, N), want["src_info"], err_msg=f"{ctx} src_info")
    np.testing.assert_array_equal(layout_range.reshape(R, L, R), want["layout_range"], err_msg=f"{ctx} layout_range")
    valid = np.arange(N)[None, None, :] < want["recv_count"][..., None]
    got_rows = recv_x.reshape(R, L, N, H).view(np.uint16)
    np.testing.assert_array_equal(np.where(valid[..., None], got_rows, 0), want["recv_x"].view(np.uint16),
                                  err_msg=f"{ctx} recv_x (valid rows)")
    assert int(want["recv_count"].sum()) > 0, ctx
    if mode == "per_rank":
        msg_token, token_rows = oracle.low_latency_message_tables(idx, E, R, T)
        np.testing.assert_array_equal(got[5].reshape(R, R, T), msg_token, err_msg=f"{ctx} handle.msg_token")
        np.testing.assert_array_equal(got[6].reshape(R, R, T, K), token_rows, err_msg=f"{ctx} handle.token_rows")
    # combine of the received rows vs the oracle's f64 sum: f32 accumulation in any order, rounded to bf16
    expert_out = want["recv_x"]
    _, acc = oracle.low_latency_combine(expert_out, idx, w, want["src_info"], want["layout_range"], E,
                                        accum=np.float64, return_acc=True)
    _, sabs = oracle.low_latency_combine(np.abs(expert_out.astype(np.float64)), idx, np.abs(w), want["src_info"],
                                         want["layout_range"], E, accum=np.float64, return_acc=True)
    err = K * 2.0 ** -23 * sabs + (2.0 ** -8 * sabs if mode == "per_rank" else 0.0)
    diff = np.abs(y.reshape(R, T, H).astype(np.float64) - acc)
    bad = ~(diff <= 2.0 ** -8 * (np.abs(acc) + err) + err)
    assert not bad.any(), f"{ctx} low_latency_combine: {int(bad.sum())} entries out of tolerance"


def main():
    devices = jax.devices()
    assert len(devices) >= max(GROUP_SIZES), f"needs {max(GROUP_SIZES)} devices, got {len(devices)}"
    for R in GROUP_SIZES:
        t0 = time.perf_counter()
        mesh = Mesh(np.array(devices[:R]), ("ep",))
        E = 2 * R
        rng = np.random.default_rng(R)
        x = jnp.asarray(rng.standard_normal((R * T, H)), jnp.bfloat16)
        idx = random_topk(rng, R * T, E, K)
        idx[rng.random(idx.shape) < 0.1] = -1
        w = rng.random((R * T, K)).astype(np.float32)
        args = (x, jnp.asarray(idx), jnp.asarray(w))
        per_rank = (np.asarray(x).reshape(R, T, H), idx.reshape(R, T, K), w.reshape(R, T, K))

        def config(nvl, mode="per_expert"):
            return jax_ep.EPConfig(E, H, K, T, backend="reference", num_max_nvl_peers=nvl, low_latency_mode=mode)

        # normal mode: every split, then the oracle on one of them (the others are the same bytes)
        normal = {}
        for nvl in SPLITS:
            cfg = config(nvl)
            assert cfg.normal_over_nvshmem(R) and cfg.low_latency_over_nvshmem(R)
            normal[nvl] = run(normal_program(cfg, mesh), args)
        for nvl in SPLITS[:-1]:
            same_bytes(normal[nvl], normal[SPLITS[-1]], f"R={R} normal mode: num_max_nvl_peers={nvl} != "
                                                         f"{SPLITS[-1]}")
        rows = check_normal(R, E, *per_rank, normal[SPLITS[-1]])
        assert rows > 0
        # normal mode on the NVLink kernels takes at most kMaxNvlPeers = 8 ranks
        expect_error(lambda: normal_program(config(R), mesh).trace(*args), "jax_ep.dispatch", f"{R} ranks",
                     "kMaxNvlPeers")
        # low-latency mode, both modes: every split, the oracle, and one node of R ranks (no limit there)
        for mode in MODES:
            ll = {nvl: run(low_latency_program(config(nvl, mode), mesh), args) for nvl in SPLITS + (R,)}
            for nvl in SPLITS[:-1] + (R,):
                same_bytes(ll[nvl], ll[SPLITS[-1]], f"R={R} low-latency {mode}: num_max_nvl_peers={nvl} != "
                                                    f"{SPLITS[-1]}")
            check_low_latency(R, E, *per_rank, ll[SPLITS[-1]], mode)
        print(f"OK R={R} rows={rows} ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="jax_ep_wide_group_cache_") as cache:
        # before the first compile: identical programs (the splits') compile once
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        main()
