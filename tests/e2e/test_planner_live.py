"""The planner live: a load step grows the prefill pool, its end shrinks it again."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
import yaml

from pdserve.bench import arrivals, workloads
from pdserve.bench.runner import grpc_send, run_jobs
from pdserve.client import AsyncClient
from pdserve.planner.perf_model import PerfModel
from pdserve.router.metrics_text import sample_value
from tests.e2e.harness import running, stats, tiny_settings, wait_until

POLICY = {
    "name": "test", "interval_s": 1.0, "ttft_target_s": 1.0, "itl_target_s": 10.0,
    "min_prefill_workers": 1, "max_prefill_workers": 2,
    "min_decode_workers": 1, "max_decode_workers": 1,
    "scale_up_cooldown_s": 3.0, "scale_down_cooldown_s": 4.0, "low_water": 0.5,
    "headroom": 0.0,
    "cost_model": "profile",  # PERF below, not the tiny model's own (much faster) steps
}
# One prefill worker "does" 800 prompt tokens/s: at the 1 s TTFT target (M/D/1, 64-token
# prompts: S = 0.08 s, utilisation <= 2(1 - 0.08)/(2 - 0.08) = 0.958) it carries 767 tok/s,
# so 16 req/s x 64 tokens = 1024 tok/s needs ceil(1.34) = 2 workers; no load needs 1.
PERF = PerfModel(prefill_tokens_per_s=800.0, decode_a_s=0.01, decode_b_s=0.001, decode_c_s=0.0)
RATE, INPUT, OUTPUT, NUM = 16.0, 64, 4, 112  # about 7 s of load


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planner")
    (tmp / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    PERF.save(tmp / "perf.json")
    settings = tiny_settings(tiny_llama_dir, ray_cluster.address,
                             planner_policy=str(tmp / "policy.yaml"),
                             planner_perf=str(tmp / "perf.json"))
    with running(settings) as service:
        yield service


def prefill_workers(address: str) -> list[str]:
    return sorted(w.worker_id for w in stats(address).workers if w.role == "prefill" and w.up)


def desired(service, role: str) -> float:
    url = f"http://127.0.0.1:{service.service.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sample_value(text, "pdserve_planner_desired_workers", {"role": role})


def test_load_step_scales_prefill_up_then_back_down(service, caplog):
    caplog.set_level("INFO", logger="pdserve.planner.live")
    assert prefill_workers(service.address) == ["prefill-0"]
    jobs = [[r] for r in workloads.grid([INPUT], [OUTPUT], NUM, 49152, seed=3)]
    times = arrivals.poisson_times(len(jobs), RATE, 1.0, seed=3)

    async def load():
        async with AsyncClient(service.address, timeout=120) as client:
            return await run_jobs(grpc_send(client), jobs, times, progress=False)

    started = time.monotonic()
    records, _ = asyncio.run(load())
    assert all(r.ok for r in records)
    # the first interval under load asks for 2; the new worker serves after its start-up
    wait_until(lambda: prefill_workers(service.address) == ["prefill-0", "prefill-1"],
               30, "a second prefill worker")
    scaled_up_after = time.monotonic() - started
    assert any("prefill 1->2" in r.getMessage() for r in caplog.records)
    # no load: desired drops to 1, the newest worker drains after the scale-down cooldown
    wait_until(lambda: prefill_workers(service.address) == ["prefill-0"], 30,
               "back to one prefill worker")
    assert desired(service, "prefill") == 1
    assert any("prefill 2->1" in r.getMessage() for r in caplog.records)
    assert scaled_up_after < 30
