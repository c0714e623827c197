"""The launcher: what `pdserve up` runs, and the checks of a deployment before it runs.

- `service`: `Service`, everything `pdserve up` starts and stops (Redis, Ray workers, the
  router, metrics, supervision, the live planner when configured).
- `settings`: `ServeSettings`, every knob of `pdserve up` (flag, PDSERVE_* variable, config key).
- `ray_runtime`: join a Ray cluster, or start a local head bound to loopback.
- `pool`: `WorkerPool`, the workers placed on Ray: started, scaled, stopped.
- `worker`: `Worker`, one worker's Ray actors and placement group; `WorkerInfo`.
- `supervisor`: `Supervisor`, health pings and whole-worker restarts.
- `redis_server`: `RedisServer`, the bundled redis-server subprocess.
- `deploy_check`: a Ray cluster YAML checked offline,
  `python -m pdserve.launch.deploy_check deploy/ray/cluster.yaml`.
"""
