"""The autoscaling planner: how many prefill and how many decode workers the load needs.

- `perf_model`: `PerfModel`, what one worker can do (prefill tokens/s; decode step time as a
  function of batch size and context), fitted from measurements and stored as JSON.
- `profile`: measures a real engine in this process and fits a `PerfModel`.
- `policy`: `PlannerPolicy` (the YAML file users tune: SLO targets, bounds, cooldowns,
  hysteresis, cost) and `decide`, the pure decision function over one interval's
  `Observation` and the remembered `PlannerState`.
- `simulator`: a deterministic discrete-event simulation of the disaggregated service under a
  request trace, with the planner in the loop (its simulated workers and the replica
  timeline included); `evaluation` judges a run: SLO attainment, latency, cost.
- `traces`: the request traces the simulator serves (steady, bursty, from a file).
- `live`: `LivePlanner`, the same `decide` applied to a running service.
- `cli`: `pdserve plan` (compare policies on a trace) and `pdserve profile`.

The policy never does I/O: the offline simulator and the live planner (which reads the
router's Prometheus metrics and acts on Ray) call the same `decide`.
"""
