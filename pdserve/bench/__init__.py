"""`pdserve bench`: load a running service and measure it.

- `workloads`: seeded request mixes (ShareGPT-like lengths, input x output grids, multi-turn
  sessions) over random token ids.
- `arrivals`: seeded send-time schedules (Poisson with a gamma burstiness factor, fixed rate).
- `trace`: `RequestRecord`, what the runner measured for one request, and its JSON form.
- `metrics`: TTFT / TPOT / ITL / E2E, percentiles, SLOs, goodput and the run `Summary`.
- `report`: text tables, the JSON result file and the CDF / sweep plot.
- `runner`: drives a service through `AsyncClient` with a workload and its send times.
- `openai_backend`: the same turns sent to an OpenAI-compatible HTTP server instead.
- `cli`: `pdserve bench`.

The first five are pure (no torch, no network; I/O only in `report`): the planner's simulator
judges its runs with the same `metrics`.
"""
