"""The public ops (API layer): what `import jax_ep` re-exports.

    normal.py             get_dispatch_layout, dispatch, combine, capacity_mask (SPEC §3; custom_vjp rules)
    low_latency.py        low_latency_* ops and the LowLatencyState helpers (SPEC §4)
    initialize.py         jax_ep.initialize: runtime setup (runtime.setup) + one warm-up run of the ops
    validation.py         trace-time argument checks (SPEC §6)
    backend_choice.py     which backend runs an op; guarded_reference.py: the reference backend with an arrival
                          check before every op in a job of several processes

The LowLatencyState encoding and its order rules live one level down (jax_ep/low_latency_chain.py): the backends
use them too, and backends never import the ops.
"""
