"""Child program of tests/test_internode_reference.py::test_groups_of_16_and_32_ranks: runs on 32 emulated CPU
devices (the parent sets XLA_FLAGS before this imports jax). For R = 16 and 32 (up to kMaxGroupRanks) on the reference
backend: normal-mode dispatch equals the independent oracle (tests/oracle.py); dispatch, combine and the low-latency
ops give bit-identical results for every split into nodes that normal mode allows (num_max_nvl_peers 1, 4, 8); a
normal-mode group wider than 8 ranks on the NVLink kernels (num_max_nvl_peers >= R) is an EPError naming
kMaxNvlPeers, while the low-latency ops accept it and give the same results. Prints `OK R=...` lines.
"""
import _child  # noqa: F401 - the repository and tests/ (oracle, helpers) on sys.path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
import oracle  # noqa: E402
from helpers import random_topk  # noqa: E402

H, K, T = 128, 4, 4


def program(cfg, mesh, normal=True):
    def body(x, idx, w):
        outs = []
        if normal:
            out = jax_ep.dispatch(x, idx, w, cfg)
            y, yw = jax_ep.combine(out.recv_x, out.handle, cfg, topk_weights=out.recv_topk_weights)
            outs += [out.recv_x, out.recv_topk_idx, out.recv_topk_weights, out.num_recv_tokens[None], y, yw]
        ll = jax_ep.low_latency_dispatch(x, idx, cfg, use_fp8=False)
        outs += [ll.recv_x, ll.recv_count, jax_ep.low_latency_combine(ll.recv_x, idx, w, ll.handle, cfg)]
        return tuple(outs)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))


def expect_error(fn, *names):
    try:
        fn()
    except jax_ep.EPError as e:
        assert all(n in str(e) for n in names), (names, str(e))
        return
    raise AssertionError(f"no EPError naming {names}")


devices = jax.devices()
assert len(devices) == 32, devices
for R in (16, 32):
    mesh = Mesh(np.array(devices[:R]), ("ep",))
    E = 2 * R
    rng = np.random.default_rng(R)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    idx = random_topk(rng, R * T, E, K)
    idx[rng.random(idx.shape) < 0.1] = -1
    w = rng.random((R * T, K)).astype(np.float32)
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(w))
    results = {}
    for nvl in (1, 4, 8):
        cfg = jax_ep.EPConfig(E, H, K, T, backend="reference", num_max_nvl_peers=nvl)
        assert cfg.normal_over_nvshmem(R) and cfg.low_latency_over_nvshmem(R)
        results[nvl] = [np.asarray(a) for a in program(cfg, mesh)(*args)]
    for nvl in (1, 4):
        for i, (a, b) in enumerate(zip(results[nvl], results[8])):
            np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8),
                                          err_msg=f"R={R} output {i}: nvl={nvl} != nvl=8")
    recv_x, recv_idx, recv_w, n = (results[8][i] for i in range(4))
    C = recv_x.shape[0] // R
    want = oracle.dispatch(np.asarray(args[0]).reshape(R, T, H), idx.reshape(R, T, K), w.reshape(R, T, K), E, R, C)
    got_n = n.reshape(R)
    np.testing.assert_array_equal(got_n, np.asarray(want["num_recv_tokens"]).reshape(R), err_msg=f"R={R} counts")
    assert got_n.sum() > 0
    for r in range(R):
        rows = int(min(got_n[r], C))
        np.testing.assert_array_equal(recv_x.reshape(R, C, H)[r, :rows].view(np.uint16),
                                      np.asarray(want["recv_x"])[r, :rows].view(np.uint16), err_msg=f"R={R} rank {r}")
        np.testing.assert_array_equal(recv_idx.reshape(R, C, K)[r, :rows], np.asarray(want["recv_topk_idx"])[r, :rows])
    # normal mode on the NVLink kernels takes at most kMaxNvlPeers = 8 ranks; low-latency mode has no such limit
    wide = jax_ep.EPConfig(E, H, K, T, backend="reference", num_max_nvl_peers=R)
    expect_error(lambda: program(wide, mesh)(*args), "jax_ep.dispatch", f"{R} ranks", "kMaxNvlPeers")
    ll_wide = [np.asarray(a) for a in program(wide, mesh, normal=False)(*args)]
    for a, b in zip(ll_wide, results[8][6:]):
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
    print(f"OK R={R} rows={int(got_n.sum())}", flush=True)
