"""LivePlanner: the autoscaling policy applied to a running service, every `interval_s`.

Each interval it reads the router's own metrics (the difference of two scrapes of its
registry: arrivals, prompt/output tokens, TTFT and ITL histograms), its queue and the decode
workers' KV usage, builds an `Observation`, prices the workers with the step-time fits they
report (the router's own cost model, planner.measured; policy `cost_model: profile` keeps the
profile's numbers), and applies what `decide()` returns: scaling up
starts workers in the Ray pool and registers them with the router; scaling down drains the
pool's newest worker in the router (no new requests; in-flight ones finish) and then stops
it. It also asks Ray's autoscaler for the nodes the decision needs (`request_resources`) and
exports the desired counts as `pdserve_planner_desired_workers{role}` for Kubernetes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.planner.measured import measured_perf
from pdserve.planner.perf_model import PerfModel
from pdserve.planner.policy import Decision, Observation, PlannerPolicy, PlannerState, decide
from pdserve.router.metrics_text import quantile_between, sample_value
from pdserve.router.placement import step_fit
from pdserve.router.router import Router
from pdserve.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"


@dataclass(frozen=True)
class Scrape:
    time_s: float
    num_received: int
    text: str


class LivePlanner:
    def __init__(self, policy: PlannerPolicy, perf: PerfModel, router: Router, pool,
                 make_spec: Callable[[str, str], WorkerSpec], decode_tp: int = 1) -> None:
        self.policy, self.perf, self.router, self.pool = policy, perf, router, pool
        self.make_spec, self.decode_tp = make_spec, decode_tp
        self.state = PlannerState()
        self._means = (0.0, 0.0)  # mean input / output tokens, kept while nothing finishes
        self._started = time.monotonic()

    async def run(self) -> None:
        last = self._scrape()
        while True:
            await asyncio.sleep(self.policy.interval_s)
            now = self._scrape()
            obs = self.observe(last, now)
            last = now
            perf = self.cost_model()
            decision, self.state = decide(self.policy, perf, obs, self.state)
            for role, count in (("prefill", decision.num_prefill),
                                ("decode", decision.num_decode)):
                self.router.metrics.set_planner_desired(role, count)
            if (decision.num_prefill, decision.num_decode) != (obs.num_prefill, obs.num_decode):
                logger.info("planner: %s (prefill %.0f tok/s, %s; decode step %.3g s + "
                            "%.3g s per sequence, %s)", decision.reason,
                            perf.prefill_tokens_per_s, perf.source.get("prefill", "profile"),
                            perf.decode_a_s, perf.decode_b_s,
                            perf.source.get("decode", "profile"))
                try:
                    await self.apply(decision)
                except Exception:  # a failed scale step is retried at the next interval
                    logger.exception("planner could not apply %s", decision)
                last = self._scrape()  # what happened while scaling belongs to no interval

    def observe(self, last: Scrape, now: Scrape) -> Observation:
        span = max(now.time_s - last.time_s, 1e-9)
        done = _delta(last, now, "pdserve_requests_total", {"status": "ok"})
        if done > 0:
            self._means = (_delta(last, now, "pdserve_prompt_tokens_total") / done,
                           _delta(last, now, "pdserve_generation_tokens_total") / done)
        prefill = self._serving(self.router.prefill)
        decode = self._serving(self.router.decode)
        loads = [c.load for c in decode if c.load is not None and c.load.num_blocks]
        return Observation(
            time_s=now.time_s - self._started,
            request_rate=(now.num_received - last.num_received) / span,
            mean_input_tokens=self._means[0], mean_output_tokens=self._means[1],
            ttft_p90_s=_p90(last, now, TTFT), itl_p90_s=_p90(last, now, ITL),
            queue_depth=self.router.admission.num_queued + sum(c.num_inflight for c in prefill),
            kv_usage=(sum(1 - x.num_free_blocks / x.num_blocks for x in loads) / len(loads)
                      if loads else 0.0),
            num_prefill=len(prefill), num_decode=len(decode),
        )

    def cost_model(self) -> PerfModel:
        """What one worker of each pool can do: as its serving workers measured it (their
        step-time fits, which the router places prompts by), or the profile's numbers."""
        if self.policy.cost_model == "profile":
            return self.perf
        prefill = [(fit, max(c.load.step_token_budget, 1))
                   for c in self._serving(self.router.prefill)
                   if (fit := step_fit(c.load, fitted_only=True)) is not None]
        decode = [fit for c in self._serving(self.router.decode)
                  if (fit := step_fit(c.load, fitted_only=False)) is not None]
        return measured_perf(self.perf, prefill, decode)

    async def apply(self, decision: Decision) -> None:
        for role, want in (("prefill", decision.num_prefill), ("decode", decision.num_decode)):
            clients = self.router.prefill if role == "prefill" else self.router.decode
            serving = sorted((c.worker_id for c in self._serving(clients)), key=_index)
            for _ in range(want - len(serving)):
                worker_id = f"{role}-{self._next_index(role)}"
                tp = self.decode_tp if role == "decode" else 1
                info = await self.pool.add(self.make_spec(worker_id, role), role, tp)
                await self.router.add_worker(info.worker_id, role, info.address)
            for worker_id in reversed(serving[want:]):  # the newest go first
                await self.router.drain(worker_id)
                await self.pool.remove(worker_id)
        self._request_nodes(decision)

    def _request_nodes(self, decision: Decision) -> None:
        """Tell Ray's autoscaler (when there is one) what the pools need, so nodes come up."""
        from ray.autoscaler.sdk import request_resources

        bundles = [{"prefill": 1}] * decision.num_prefill
        bundles += [{"decode": 1}] * decision.num_decode
        try:
            request_resources(bundles=bundles)
        except Exception as exc:  # a local head has no autoscaler to ask
            logger.debug("request_resources: %r", exc)

    def _next_index(self, role: str) -> int:
        taken = [_index(w) for w in (self.router.prefill if role == "prefill"
                                     else self.router.decode)]
        return max(taken, default=-1) + 1

    def _scrape(self) -> Scrape:
        return Scrape(time.monotonic(), self.router.total_received,
                      self.router.metrics.render().decode())

    @staticmethod
    def _serving(clients: dict) -> list:
        return [c for c in clients.values() if not c.draining]


def _index(worker_id: str) -> int:
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _delta(last: Scrape, now: Scrape, name: str, labels: dict | None = None) -> float:
    return sample_value(now.text, name, labels) - sample_value(last.text, name, labels)


def _p90(last: Scrape, now: Scrape, name: str) -> float:
    return quantile_between(last.text, now.text, name, 0.9)
