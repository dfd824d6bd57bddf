"""The CUDA backend in one process driving its GPUs (jax_ep.backends.cuda, NVLink kernels) vs the reference backend
on the same GPUs (bit-identical where SPEC §7 says so).

Skips with the reason printed when there is no CUDA GPU or no native extension. Run on the GPU machine through
`scripts/gpu.sh suite` (`cmdbuf`: the command-buffer variants; `sanitize`: tests/programs/sanitize/).
"""

import os

import zlib

import numpy as np
import pytest

import cuda_backend_harness as h  # tests/gpu is on sys.path (pytest rootdir-relative import of this file's dir)

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_ep import _native
from jax_ep.backends import reference
from cuda_backend_harness import cuda_backend
from jax_ep.config import EPConfig

_reason = h.skip_reason(1)  # cases for more GPUs than the machine has skip one by one
if _reason:
    print(f"tests/gpu/test_cuda_backend.py skipped: {_reason}")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason is not None, reason=str(_reason))]

# (R, T, T_max, H, K, E, routing, capacity, fp8)
CASES = [
    (1, 1, 1, 2048, 1, 8, "deepep", None, False),           # one GPU: the local path and the fixed costs
    (1, 256, 256, 7168, 8, 16, "deepep", None, False),
    (1, 1000, 1024, 7168, 8, 64, "messy", None, False),
    (1, 17, 17, 7168, 8, 32, "skewed", 10, False),          # capacity overflow
    (1, 8192, 8192, 8192, 8, 64, "deepep", None, False),    # T=8192, H=8192 (issue 12)
    (1, 256, 256, 7168, 8, 16, "messy", None, True),
    (2, 1, 1, 2048, 1, 8, "deepep", None, False),
    (2, 8192, 8192, 8192, 8, 64, "deepep", None, False),
    (2, 17, 32, 7168, 8, 16, "messy", None, False),
    (2, 4096, 4096, 2048, 8, 64, "deepep", None, False),
    (2, 17, 17, 2048, 16, 32, "messy", None, False),
    (2, 17, 17, 7168, 8, 32, "skewed", 20, True),         # capacity overflow, fp8 + scales
    (4, 1, 8, 7168, 1, 8, "messy", None, False),
    (4, 17, 17, 2048, 8, 32, "messy", None, False),
    (4, 4096, 4096, 7168, 8, 256, "deepep", None, False),
    (4, 4096, 4096, 2048, 1, 64, "messy", None, False),
    (4, 17, 17, 7168, 8, 32, "skewed", 20, False),        # capacity overflow
    (4, 4096, 4096, 2048, 8, 256, "messy", 5000, False),  # overflow at scale
    (4, 17, 17, 7168, 8, 32, "messy", None, True),        # fp8 + scales
    (4, 4096, 4096, 7168, 8, 256, "deepep", None, True),
]


def _cfg(R, T_max, H, K, E, cap):
    return EPConfig(num_experts=E, hidden=H, num_topk=K, max_tokens_per_rank=T_max, axis_name="ep",
                    recv_capacity=cap, backend="cuda", timeout_seconds=20.0)


_groups = {}


def _group(R):
    if R not in _groups:
        cfgs = [_cfg(c[0], c[2], c[3], c[4], c[5], c[7]) for c in CASES if c[0] == R]
        cfgs.append(_cfg(R, 128, 2048, 8, 64, None))  # scan test
        _groups[R] = h.Group(R, cfgs)
        print(f"group R={R}: {_groups[R].info}")
    return _groups[R]


@pytest.fixture(scope="module", autouse=True)
def _close_groups():
    yield
    for g in _groups.values():
        g.close()
    _groups.clear()


def _setup(case):
    """The group and config of a CASES entry (skips when the GPUs are missing) and its inputs, seeded by the case."""
    R, T, T_max, H, K, E, mode, cap, fp8 = case
    h.require(R)
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    return _group(R), _cfg(R, T_max, H, K, E, cap), h.inputs(rng, R, T, H, K, E, mode, fp8)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "R{}-T{}-Tmax{}-H{}-K{}-E{}-{}-C{}-{}".format(
    *c[:8], "fp8" if c[8] else "bf16"))
def test_matches_reference(case):
    R, mode = case[0], case[6]
    group, cfg, (x, s, idx, w) = _setup(case)
    res = h.run_case(group, cfg, R, x, s, idx, w)
    n_recv = np.asarray(res["cuda"]["dispatch"].num_recv_tokens).ravel()
    print(f"{case}: num_recv_tokens per rank {n_recv.tolist()} (capacity {cfg.capacity(R)})")
    problems = h.compare(res)
    assert not problems, "\n".join(problems)
    if mode == "skewed":
        assert n_recv.max() > cfg.capacity(R), "overflow case did not overflow"


def _scan_program(group, cfg, R, steps, back_to_back=False):
    """`steps` dispatch+combine rounds in one lax.scan, fresh messy routing each step, both backends compared in
    the graph; returns per-step mismatch counts (exact fields) and max |dy|. back_to_back: each step first runs one
    more dispatch (other routing, other rows, compared too) right before the step's own, so consecutive dispatches
    meet with nothing in between (their count exchange is their only rendezvous)."""
    E, K, T = cfg.num_experts, cfg.num_topk, cfg.max_tokens_per_rank

    def neq(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.dtype == jnp.bfloat16:
            a, b = lax.bitcast_convert_type(a, jnp.uint16), lax.bitcast_convert_type(b, jnp.uint16)
        elif a.dtype == jnp.float32:
            a, b = lax.bitcast_convert_type(a, jnp.uint32), lax.bitcast_convert_type(b, jnp.uint32)
        return jnp.sum(a != b, dtype=jnp.int32)

    def body(x, key):
        me = lax.axis_index("ep")

        def step(carry, i):
            idx, w = h.step_routing(key, i, T, K, E, jax.random.normal)
            xi = x + (i % 7).astype(x.dtype)
            mism = jnp.zeros((), jnp.int32)
            if back_to_back:
                idx0, w0 = h.step_routing(key, i + steps, T, K, E, jax.random.normal)
                x0 = x - (i % 5).astype(x.dtype)
                oc0 = cuda_backend.dispatch(x0, None, idx0, w0, cfg, R)
                or0 = reference.dispatch(x0, None, idx0, w0, cfg, R)
                mism += sum(neq(a, b) for a, b in zip(jax.tree.leaves(oc0), jax.tree.leaves(or0)))
            oc = cuda_backend.dispatch(xi, None, idx, w, cfg, R)
            orf = reference.dispatch(xi, None, idx, w, cfg, R)
            mism += sum(neq(a, b) for a, b in zip(jax.tree.leaves(oc), jax.tree.leaves(orf)))
            yc, ywc = cuda_backend.combine(oc.recv_x, oc.recv_topk_weights, oc.handle, cfg, R)
            yr, ywr = reference.combine(orf.recv_x, orf.recv_topk_weights, orf.handle, cfg, R)
            # relative to the largest |y|: f32 sums in another order may round to a neighbouring bf16 value
            def rel(a, b):
                a, b = a.astype(jnp.float32), b.astype(jnp.float32)
                return jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b)))
            dy = jnp.maximum(rel(yc, yr), rel(ywc, ywr))
            return carry + mism, (mism, dy)

        zero = jnp.zeros((), jnp.int32) + 0 * me  # varying over 'ep', like the carry the step returns
        total, (mism, dy) = lax.scan(step, zero, jnp.arange(steps))
        return total[None], mism[None], dy[None]

    return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"), P()),
                                 out_specs=(P("ep"), P("ep"), P("ep"))))


def test_scan_200_calls_changing_routing():
    R = min(4, len(h.gpu_devices()))
    group = _group(R)
    cfg = _cfg(R, 128, 2048, 8, 64, None)
    group.activate()
    f = _scan_program(group, cfg, R, 200)
    x = group.shard(np.random.default_rng(1).standard_normal((R * 128, 2048)).astype(jnp.bfloat16))
    key = jax.random.key_data(jax.random.key(0))[None]
    compiled = f.lower(x, key).compile()
    text = compiled.as_text()
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", ""), "| command buffers in compiled HLO:",
          text.count("command_buffer"), "| jax_ep custom calls:", text.count("jax_ep_"))
    total, mism, dy = jax.device_get(compiled(x, key))
    print(f"scan: mismatching elements total per rank {total.tolist()}, max relative |dy| {float(dy.max()):.3e}")
    assert int(total.sum()) == 0, f"steps with mismatches: {np.argwhere(mism > 0)[:10].tolist()}"
    assert float(dy.max()) <= 2 ** -7  # one bf16 ulp of the largest value


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_scan_back_to_back_dispatches(path):
    R = min(4, len(h.gpu_devices()))
    group = _group(R)
    cfg = _cfg(R, 128, 2048, 8, 64, None)
    group.activate()
    native = _native.module()
    was = native.direct_buffers_enabled()
    native.set_direct_buffers(path == "direct")
    try:
        f = _scan_program(group, cfg, R, 100, back_to_back=True)
        x = group.shard(np.random.default_rng(2).standard_normal((R * 128, 2048)).astype(jnp.bfloat16))
        key = jax.random.key_data(jax.random.key(1))[None]
        total, mism, dy = jax.device_get(f(x, key))
    finally:
        native.set_direct_buffers(was)
    print(f"back-to-back ({path}): mismatching elements total per rank {total.tolist()}, "
          f"max |dy| {float(dy.max()):.3e}")
    assert int(total.sum()) == 0, f"steps with mismatches: {np.argwhere(mism > 0)[:10].tolist()}"
    assert float(dy.max()) <= 2 ** -7


# Direct buffers (dispatch's senders write into the receiver's outputs, combine reads the peers' inputs; XLA's
# allocator gives peer-addressable buffers in one process) and staging: both bit-identical to the reference, padding
# rows, capacity overflow, f32 combine and combine without weights included; the native count says which path each
# call took. "pull": every combine pulls (threshold 0); "push": the default threshold, above these outputs, so the
# combines push; "staged": direct buffers off.
DIRECT_CASES = [
    (2, 17, 32, 7168, 8, 16, "messy", None, False),
    (2, 17, 17, 7168, 8, 32, "skewed", 20, True),
    (4, 17, 17, 7168, 8, 32, "skewed", 20, False),
    # T=4096: many chunks of arrivals in run_case's cached dispatch (its copy-out runs under the send), the capacity
    # cutting one mid-chunk
    (4, 4096, 4096, 2048, 8, 256, "messy", 5000, False),
    (4, 4096, 4096, 7168, 8, 256, "deepep", None, True),
]
assert all(c in CASES for c in DIRECT_CASES), "the groups are sized for the configs of CASES"


@pytest.mark.parametrize("path", ["pull", "push", "staged"])
@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: "R{}-T{}-{}-C{}-{}".format(
    c[0], c[1], c[6], c[7], "fp8" if c[8] else "bf16"))
def test_direct_buffers_and_staging_match_reference(case, path):
    R, T, H = case[0], case[1], case[3]
    group, cfg, (x, s, idx, w) = _setup(case)
    group.activate()  # before the count: initialize's warm-up ops (a new group) take the direct path too
    native = _native.module()
    was, threshold = native.direct_buffers_enabled(), native.pull_combine_min_bytes()
    assert path != "push" or T * H * 4 < threshold, "the default threshold must be above this case's combines"
    native.set_direct_buffers(path != "staged")
    if path == "pull":
        native.set_pull_combine_min_bytes(0)
    try:
        before = native.direct_buffer_calls()
        res = h.run_case(group, cfg, R, x, s, idx, w)
        direct_calls = native.direct_buffer_calls() - before
    finally:
        native.set_direct_buffers(was)
        native.set_pull_combine_min_bytes(threshold)
    print(f"{case} {path}: {direct_calls} calls used direct buffers")
    problems = h.compare(res)
    assert not problems, "\n".join(problems)
    # run_case: one dispatch and two combines (bf16 with weights, f32 without) per device; cached dispatch stages
    assert direct_calls == {"pull": 3 * R, "push": R, "staged": 0}[path], direct_calls
