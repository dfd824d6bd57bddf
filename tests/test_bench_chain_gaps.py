"""jax_ep.bench.chain_gaps: the trace analysis on synthetic events (the GPU run itself needs the profiler)."""

import math

from jax_ep.bench.__main__ import parse_args
from jax_ep.bench.chain_gaps import _phase_readers, device_ops, gap_report, phase_table, short_name, sweeps_of


def _ev(name, ts, dur, pid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid}


def _calls(namespace, call, period, n=4):
    """n copies of one call's (kernel, start, duration) list, `period` us apart, named as the profiler names them."""
    return [_ev(f"void {namespace}::(anonymous namespace)::{k}(P)", ts + period * i, d)
            for i in range(n) for k, ts, d in call]


def test_short_name_drops_namespaces_templates_and_parameters():
    assert short_name("void jax_ep::nvshmem::(anonymous namespace)::nvshmem_dispatch_send_kernel(DispatchSendParams, int)") \
        == "nvshmem_dispatch_send_kernel"
    assert short_name("void jax_ep::low_latency::low_latency_dispatch_send_kernel<false>(jax_ep::low_latency::DispatchSendParams)") \
        == "low_latency_dispatch_send_kernel"
    assert short_name("loop_convert_fusion") == "loop_convert_fusion"


def test_gap_report_durations_gaps_and_period_of_the_first_gpu():
    # two calls of (send 10 us, gap 5, recv 20 us, gap 3) on GPU pid 1; pid 2 must be ignored
    ops = [_ev("a::send_kernel(P)", 0, 10), _ev("recv_kernel(P)", 15, 20), _ev("a::send_kernel(P)", 38, 10),
           _ev("recv_kernel(P)", 53, 20), _ev("send_kernel", 5, 1, pid=2)]
    durs, gaps, period = gap_report(sorted(ops, key=lambda e: e["ts"]))
    assert durs == {"send_kernel": [10.0, 10.0], "recv_kernel": [20.0, 20.0]}
    assert gaps == {("send_kernel", "recv_kernel"): [5, 5], ("recv_kernel", "send_kernel"): [3]}
    assert period == 38


def test_device_ops_keeps_gpu_processes_only():
    events = [_ev("k", 2, 1, pid=1), _ev("host op", 1, 1, pid=9), {"ph": "M", "name": "process_name", "pid": 1}]
    procs = {1: "/device:GPU:0", 9: "/host:CPU"}
    assert [e["name"] for e in device_ops(events, procs)] == ["k"]
    durs, gaps, period = gap_report([])  # no operations: nothing to report, no period
    assert durs == {} and gaps == {} and math.isnan(period)


def test_phase_table_means_per_stamp_and_skips_unstamped_phases():
    rows = [("send: consumed waited", 3000, 2), ("recv: body done", 0, 0), ("recv: last block reached", 9000, 3)]
    assert phase_table("NVSHMEM LL kernels", rows) == [
        "| phase (NVSHMEM LL kernels) | stamps | mean us from the block's start |",
                                 "| send: consumed waited | 2 | 1.50 |", "| recv: last block reached | 3 | 3.00 |"]


def test_phase_reader_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("JAX_EP_TEST_PHASES", raising=False)
    assert _phase_readers("normal") == [] and _phase_readers("low_latency") == []


def test_period_of_normal_mode_from_its_one_send_kernel_per_call():
    # a forwarded dispatch call: notify, send rows, wait, forward, wait, copy-out; period = send-rows to send-rows
    call = [("nvshmem_notify_kernel", 0, 5), ("nvshmem_send_rows_kernel<8>", 6, 50), ("nvshmem_wait_data_kernel", 57, 2),
            ("nvshmem_forward_kernel", 60, 30), ("nvshmem_wait_data_kernel", 91, 2), ("recv_copy_kernel", 94, 20)]
    ops = [_ev(f"void jax_ep::nvshmem::{n}(P)", ts + 120 * i, d) for i in range(3) for n, ts, d in call]
    _, _, period = gap_report(ops)
    assert period == 120
    combine = [_ev("nvshmem_combine_send_kernel(P)", 0, 40), _ev("nvshmem_combine_forward_kernel<bf16>(P)", 45, 30),
               _ev("nvshmem_combine_send_kernel(P)", 100, 40)]
    assert gap_report(combine)[2] == 100
    # the NVLink combine: publish + barrier, then one push kernel (its reduce inside, or a no-op in pull mode, followed
    # by the pull reduce and its wait); the reduce kernel must not count as a second start of the call
    nvlink = [("combine_publish_barrier_kernel", 0, 4), ("combine_push_kernel<__nv_bfloat16>", 5, 2),
              ("combine_reduce_kernel<__nv_bfloat16>", 8, 500), ("combine_wait_kernel", 509, 1)]
    assert gap_report(_calls("jax_ep::normal", nvlink, 520, n=3))[2] == 520
    # the NVLink dispatch through staging: notify, one send-and-copy kernel, the one-warp wait
    staged = [("dispatch_notify_kernel", 0, 17), ("send_copy_kernel", 18, 510), ("wait_data_kernel", 529, 1)]
    assert gap_report(_calls("jax_ep::normal", staged, 540, n=3))[2] == 540


def test_period_of_per_rank_low_latency_ops_from_the_dispatch_send_and_the_fused_combine():
    # per_rank: dispatch as send (18 us) + receive (11 us), combine as one fused kernel (28 us); 62 us per pair
    call = [("low_latency_dispatch_send_kernel<true>", 0, 18), ("low_latency_per_rank_dispatch_recv_kernel", 19, 11),
            ("low_latency_per_rank_combine_fused_kernel", 31, 28)]
    durs, _, period = gap_report(_calls("jax_ep::low_latency", call, 62))
    assert period == 31  # dispatch send to combine start, combine start to the next dispatch send: the recv is no start
    assert durs["low_latency_per_rank_combine_fused_kernel"] == [28.0] * 4


def test_period_of_per_expert_low_latency_ops_from_their_one_fused_kernel():
    # per_expert runs each fused op as one kernel: dispatch (27 us, then a 2 us fusion) and combine (28 us), 30 us apart
    call = [("low_latency_dispatch_fused_kernel", 0, 27), ("loop_convert_fusion", 27, 2),
            ("low_latency_combine_fused_kernel", 30, 28)]
    durs, _, period = gap_report(_calls("jax_ep::low_latency", call, 60))
    assert period == 30  # dispatch start to combine start, and combine start to the next dispatch start
    assert durs["low_latency_dispatch_fused_kernel"] == [27.0] * 4


def test_sweeps_are_low_latency_unless_the_mode_is_given():
    argv = ["--tokens", "64", "--ll-tokens", "1,8"]
    assert [s[:2] for s in sweeps_of(parse_args(argv, False), argv)] == [("low_latency", 1), ("low_latency", 8)]
    argv2 = argv + ["--mode", "normal"]
    assert [s[:2] for s in sweeps_of(parse_args(argv2, False), argv2)] == [("normal", 64)]
    argv3 = argv + ["--mode=all"]
    assert [s[0] for s in sweeps_of(parse_args(argv3, False), argv3)] == ["normal", "low_latency", "low_latency"]
