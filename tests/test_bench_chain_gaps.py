"""jax_ep.bench.chain_gaps: the trace analysis on synthetic events (the GPU run itself needs the profiler)."""

import math

from jax_ep.bench.chain_gaps import _phase_reader, device_ops, gap_report, phase_table, short_name


def _ev(name, ts, dur, pid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid}


def test_short_name_drops_namespaces_templates_and_parameters():
    assert short_name("void jax_ep::rdma::(anonymous namespace)::rdma_dispatch_send_kernel(DispatchSendParams, int)") \
        == "rdma_dispatch_send_kernel"
    assert short_name("void jax_ep::ll::ll_dispatch_send_kernel<false>(jax_ep::ll::DispatchSendParams)") \
        == "ll_dispatch_send_kernel"
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
    assert phase_table(rows) == ["| phase (NVSHMEM LL kernels) | stamps | mean us from the block's start |",
                                 "| send: consumed waited | 2 | 1.50 |", "| recv: last block reached | 3 | 3.00 |"]


def test_phase_reader_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("JAX_EP_TEST_LL_PHASES", raising=False)
    assert _phase_reader() is None
