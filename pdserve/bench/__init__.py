"""`pdserve bench`: the pure library behind the serving benchmark.

- `workloads`: seeded request mixes (ShareGPT-like lengths, input x output grids, multi-turn
  sessions) over random token ids.
- `arrivals`: seeded send-time schedules (Poisson with a gamma burstiness factor, fixed rate).
- `trace`: `RequestRecord`, what the runner measured for one request, and its JSON form.
- `metrics`: TTFT / TPOT / ITL / E2E, percentiles, SLOs, goodput and the run `Summary`.
- `report`: text tables, the JSON result file and the CDF / sweep plot.

No torch, no I/O outside `report`, no network: the async runner and the CLI live elsewhere.
"""
