"""Child program of tests/test_bad_inputs.py::test_initialize_and_ops_refuse_257_ranks: runs on 257 emulated CPU
devices (the parent sets XLA_FLAGS before this imports jax). An EP group of 257 ranks, one above kMaxGroupRanks
(256), is an EPError naming the limit on every backend ("reference", "auto", "cuda"): from jax_ep.initialize (which
keeps the runtime it had), from buffer_size_hint, and from every op while it is traced. A group of 256 ranks passes
the same checks. Nothing is compiled or executed. Prints `OK <check>` lines.
"""
import _child  # noqa: F401 - the repository and tests/ (oracle, helpers) on sys.path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import runtime  # noqa: E402

H, K, T = 128, 2, 2
LIMIT = 256


def expect_error(fn, *names):
    try:
        fn()
    except jax_ep.EPError as e:
        assert type(e) is jax_ep.EPError, type(e)
        assert all(n in str(e) for n in names), (names, str(e))
        return str(e)
    raise AssertionError(f"no EPError naming {names}")


def ops(cfg, R):
    """name -> body(x, idx, w) calling that op (handles of the right shapes, made from zeros)."""
    L, C = cfg.num_experts // R, cfg.capacity(R)

    def dispatch_handle():
        z = jnp.zeros
        return jax_ep.DispatchHandle(send_pos=z((T, R), jnp.int32), recv_src_idx=z((C,), jnp.int32),
                                     recv_src_rank=z((C,), jnp.int32), recv_rank_counts=z((R,), jnp.int32),
                                     send_row_offset=z((R,), jnp.int32))

    def ll_handle():
        return jax_ep.LowLatencyHandle(src_info=jnp.zeros((L, R * T), jnp.int32),
                                       layout_range=jnp.zeros((L, R), jnp.int32))

    expert_rows = lambda: jnp.zeros((L, R * T, H), jnp.bfloat16)  # noqa: E731
    return {
        "get_dispatch_layout": lambda x, i, w: jax_ep.get_dispatch_layout(i, cfg).is_token_in_rank,
        "dispatch": lambda x, i, w: jax_ep.dispatch(x, i, w, cfg).recv_x,
        "combine": lambda x, i, w: jax_ep.combine(jnp.zeros((C, H), jnp.bfloat16), dispatch_handle(), cfg)[0],
        "low_latency_dispatch": lambda x, i, w: jax_ep.low_latency_dispatch(x, i, cfg, use_fp8=False).recv_x,
        "low_latency_dispatch_send": lambda x, i, w: jax_ep.low_latency_dispatch_send(x, i, cfg).buffers[0],
        "low_latency_combine": lambda x, i, w: jax_ep.low_latency_combine(expert_rows(), i, w, ll_handle(), cfg),
        "low_latency_combine_send": lambda x, i, w: jax_ep.low_latency_combine_send(expert_rows(), i, w, ll_handle(),
                                                                                   cfg).buffers[0],
    }


def trace(body, mesh, R):
    args = (jnp.zeros((R * T, H), jnp.bfloat16), jnp.zeros((R * T, K), jnp.int32), jnp.zeros((R * T, K), jnp.float32))
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))).trace(*args)


def main():
    devices = jax.devices()
    assert len(devices) == LIMIT + 1, len(devices)
    small = Mesh(np.array(devices[:8]), ("ep",))
    before = jax_ep.initialize(small, jax_ep.EPConfig(16, H, K, T, backend="reference"))
    for R, ok in ((LIMIT + 1, False), (LIMIT, True)):
        mesh = Mesh(np.array(devices[:R]), ("ep",))
        for backend in ("reference", "auto", "cuda"):
            cfg = jax_ep.EPConfig(2 * R, H, K, T, backend=backend, num_max_nvl_peers=8)
            names = (f"{R} ranks", f"at most {LIMIT}", "kMaxGroupRanks")
            if not ok:
                msg = expect_error(lambda: jax_ep.initialize(mesh, cfg), "jax_ep.initialize", "mesh axis 'ep'", *names)
                assert runtime.current() is before, "a refused initialize must keep the runtime it had"
                print(f"OK initialize backend={backend} R={R}: {msg}", flush=True)
                expect_error(lambda: jax_ep.buffer_size_hint(cfg, R), "jax_ep.buffer_size_hint", *names)
                print(f"OK buffer_size_hint backend={backend} R={R}", flush=True)
            elif backend == "reference":  # the other backends need CUDA devices and the extension here
                assert jax_ep.initialize(mesh, cfg).groups["ep"][0].device_ids == tuple(d.id for d in devices[:R])
                print(f"OK initialize backend={backend} R={R} accepted", flush=True)
            for op, body in ops(cfg, R).items():
                if ok:
                    if backend == "reference":
                        trace(body, mesh, R)
                        print(f"OK {op} backend={backend} R={R} accepted", flush=True)
                    continue
                expect_error(lambda: trace(body, mesh, R), f"jax_ep.{op}", "cfg.axis_name='ep'", *names)
                print(f"OK {op} backend={backend} R={R}", flush=True)


if __name__ == "__main__":
    main()
