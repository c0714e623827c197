"""Prometheus metrics of one router, in a registry of its own (several routers may share a
process in tests without their series clashing).

With several router processes (`--router-processes`), the service process's router adds the
others' expositions as sources (`add_source`): its `render()` and /metrics then show the whole
service (summed as pdserve.router.metrics_merge says), while `registry` stays its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from pdserve import defaults
from pdserve.router.disaggregation import LOCAL, REASONS, REMOTE, Decision
from pdserve.router.histogram import CountingHistogram
from pdserve.router.metrics_kv_tiers import KVTierMetrics
from pdserve.router.metrics_merge import merge_families, parse
from pdserve.router.metrics_speculation import SpeculationCounters

logger = logging.getLogger(__name__)


def _geometric(low: float, high: float, per_decade: int) -> tuple[float, ...]:
    """Bucket bounds from `low` to `high`, `per_decade` per factor of 10 (rounded to 3 digits).

    Twenty per decade (a ratio of 1.12) keeps a quantile interpolated inside a bucket within
    6% of the true value even for few samples; `pdserve bench` checks its own timings against
    these histograms.
    """
    bounds, k = [], 0
    while (bound := low * 10 ** (k / per_decade)) <= high * 1.0001:
        bounds.append(float(f"{bound:.3g}"))
        k += 1
    return tuple(bounds)


# TTFT / end-to-end / transfer latency: 1 ms to 100 s.
LATENCY_BUCKETS: tuple[float, ...] = _geometric(0.001, 100.0, 20)
# Inter-token latency: 0.1 ms (fast GPU decode) to 100 s (a stalled batch).
ITL_BUCKETS: tuple[float, ...] = _geometric(0.0001, 100.0, 20)

REQUEST_STATUSES: tuple[str, ...] = (
    "ok",
    "invalid",
    "overloaded",
    "cancelled",
    "unavailable",
    "deadline",
    "error",
)

MIGRATION_OUTCOMES: tuple[str, ...] = ("ok", "failed")
PULL_RESULTS: tuple[str, ...] = ("pulled", "held", "missed", "failed")


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


class RouterMetrics:
    """Every metric the router exports, plus an optional HTTP endpoint serving them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # what render() and /metrics show: the registry, plus the sources' expositions
        self._sources: list[Callable[[], Sequence[str]]] = []
        self.view = CollectorRegistry(auto_describe=True)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._build_latency()
        self._build_counters()
        self._build_placement()
        self._build_gauges()
        self.view.register(_ServiceView(self))

    def _build_latency(self) -> None:
        reg = self.registry
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from request arrival to first token.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = CountingHistogram(  # observed per token: the cheap kind
            "pdserve_inter_token_latency_seconds",
            "Gap between consecutive generated tokens.",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Time from request arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.transfer_latency = Histogram(
            "pdserve_kv_transfer_latency_seconds",
            "Duration of one prefill->decode KV transfer.",
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )

    def _build_counters(self) -> None:
        reg = self.registry
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV cache bytes shipped prefill->decode.", registry=reg
        )
        self.transfer_skipped_bytes = Counter(
            "pdserve_kv_transfer_skipped_bytes",
            "KV cache bytes not shipped: the decode worker's prefix cache held those blocks.",
            registry=reg,
        )
        self.requests = Counter(
            "pdserve_requests", "Finished requests by status.", ["status"], registry=reg
        )
        for status in REQUEST_STATUSES:  # export zeros so rate() works from the first scrape
            self.requests.labels(status)
        self.prompt_tokens = Counter("pdserve_prompt_tokens",
                                     "Prompt tokens of admitted requests.", registry=reg)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated.",
                                         registry=reg)
        self.prefix_queries = Counter(
            "pdserve_prefix_cache_queries_tokens",
            "Prompt tokens looked up in a prefix cache.",
            registry=reg,
        )
        self.prefix_hits = Counter(
            "pdserve_prefix_cache_hit_tokens",
            "Prompt tokens found in a prefix cache.",
            registry=reg,
        )
        self.pulls = Counter(
            "pdserve_kv_pulls", "Session prefixes a decode worker was asked to pull from the one "
            "holding them, by result (pulled; held: it had them already; missed: the holder no "
            "longer did; failed: the push failed; the last two were computed instead).",
            ["result"], registry=reg)
        for result in PULL_RESULTS:
            self.pulls.labels(result)
        self.pull_bytes = Counter(
            "pdserve_kv_pull_bytes", "KV cache bytes pulled decode->decode.", registry=reg)
        self.pull_saved_seconds = Counter(
            "pdserve_kv_pull_saved_seconds", "Prefill time pulled prefixes saved: their tokens at "
            "the measured prefill rate, less the pulls' own time.", registry=reg)
        self.migrations = Counter(
            "pdserve_router_migrations", "Requests moved to another decode worker after theirs "
            "died mid-stream, by outcome (failed: no decode worker could take it).",
            ["outcome"], registry=reg)
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        # decode workers' speculative decoding counts (`set` from their load reports)
        self.speculation = SpeculationCounters()
        reg.register(self.speculation)
        # every worker's computed tokens and KV tier counts (`set` from its load reports)
        self.kv_tiers = KVTierMetrics()
        reg.register(self.kv_tiers)

    def _build_placement(self) -> None:
        """What adaptive placement decided, and what it predicted (router.disaggregation)."""
        reg = self.registry
        self.placements = Counter(
            "pdserve_prefill_placements", "Where prompts were prefilled with adaptive placement "
            "(remote: a prefill worker; local: their decode worker), by the reason "
            "(router/disaggregation.py).", ["where", "reason"], registry=reg)
        for where in (REMOTE, LOCAL):
            for reason in REASONS:
                self.placements.labels(where, reason)
        self.predicted_ttft = Histogram(
            "pdserve_predicted_ttft_seconds", "The TTFT adaptive placement predicted for where it "
            "prefilled a prompt (from the workers' measured step times).", ["where"],
            buckets=LATENCY_BUCKETS, registry=reg)
        self.predicted_tpot = Histogram(
            "pdserve_predicted_tpot_seconds", "The decode batch's TPOT adaptive placement "
            "predicted while a prompt it placed is prefilled.", ["where"], buckets=ITL_BUCKETS,
            registry=reg)

    def _build_gauges(self) -> None:
        reg = self.registry
        self.planner_desired = Gauge(
            "pdserve_planner_desired_workers",
            "Workers the autoscaling planner wants per pool (what Kubernetes scales on).",
            ["role"], registry=reg,
        )
        self.queue_depth = Gauge("pdserve_queue_depth", "Requests waiting for admission.",
                                 registry=reg)
        self.inflight = Gauge("pdserve_requests_inflight", "Requests admitted and not finished.",
                              registry=reg)
        self.kv_blocks_total = Gauge(
            "pdserve_kv_blocks_total", "KV blocks of a worker.", ["worker"], registry=reg
        )
        self.kv_blocks_free = Gauge(
            "pdserve_kv_blocks_free", "Free KV blocks of a worker.", ["worker"], registry=reg
        )
        self.kv_usage = Gauge("pdserve_kv_usage_ratio", "Used / total KV blocks of a worker.",
                              ["worker"], registry=reg)
        self.step_token_budget = Gauge(
            "pdserve_step_token_budget",
            "Tokens a worker's next engine step may compute (a prefill worker sizes its steps "
            "in time: --prefill-step-ms).", ["worker"], registry=reg)
        self.worker_up = Gauge(
            "pdserve_worker_up",
            "1 when the worker answers health checks.",
            ["worker", "role"],
            registry=reg,
        )
        self.redis_up = Gauge("pdserve_redis_up", "1 when Redis is reachable.", registry=reg)

    # -- observations -------------------------------------------------------------------------

    def observe_ttft(self, seconds: float) -> None:
        _check_non_negative(seconds=seconds)
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, count: int = 1) -> None:
        """Record a gap of `seconds` after which one message brought `count` tokens.

        Decode streams one message per engine step, which may carry several tokens; we record
        the per-token gap seconds/count, count times. That keeps the histogram's count equal to
        the number of token gaps and its sum equal to the decode time, so the mean matches how
        clients measure ITL over streamed tokens ((e2e - ttft) / (tokens - 1), as in genai-perf,
        llmperf and vLLM's benchmark), instead of one large gap that overstates it n-fold.
        """
        if count < 1 or seconds < 0:
            raise ValueError(f"count must be >= 1 and seconds >= 0, got {count}, {seconds}")
        self.itl.observe(seconds / count, count)

    def observe_e2e(self, seconds: float) -> None:
        _check_non_negative(seconds=seconds)
        self.e2e.observe(seconds)

    def observe_transfer(self, num_bytes: int, seconds: float, skipped_bytes: int = 0) -> None:
        """One KV transfer: `num_bytes` shipped in `seconds`, `skipped_bytes` left out because
        the decode worker held them already."""
        _check_non_negative(num_bytes=num_bytes, seconds=seconds, skipped_bytes=skipped_bytes)
        self.transfer_bytes.inc(num_bytes)
        self.transfer_skipped_bytes.inc(skipped_bytes)
        self.transfer_latency.observe(seconds)

    def count_request(self, status: str) -> None:
        if status not in REQUEST_STATUSES:
            raise ValueError(f"status must be one of {REQUEST_STATUSES}, got {status!r}")
        self.requests.labels(status).inc()

    def count_pull(self, result: str, num_bytes: int = 0, saved_s: float = 0.0) -> None:
        """One prefix pull and how it ended; a landed one's bytes and the prefill time it saved
        (never below nothing)."""
        if result not in PULL_RESULTS:
            raise ValueError(f"result must be one of {PULL_RESULTS}, got {result!r}")
        _check_non_negative(num_bytes=num_bytes)
        self.pulls.labels(result).inc()
        self.pull_bytes.inc(num_bytes)
        self.pull_saved_seconds.inc(max(saved_s, 0.0))

    def observe_placement(self, decision: Decision) -> None:
        """One prompt placed by adaptive placement, and what it predicted (when measured)."""
        self.placements.labels(decision.where, decision.reason).inc()
        if decision.ttft_s is not None:
            self.predicted_ttft.labels(decision.where).observe(decision.ttft_s)
        if decision.tpot_s is not None:
            self.predicted_tpot.labels(decision.where).observe(decision.tpot_s)

    def count_migration(self, outcome: str) -> None:
        if outcome not in MIGRATION_OUTCOMES:
            raise ValueError(f"outcome must be one of {MIGRATION_OUTCOMES}, got {outcome!r}")
        self.migrations.labels(outcome).inc()

    def count_tokens(self, prompt: int, generated: int, cached: int) -> None:
        """Prompt and generated tokens of one request; `cached` of its prompt tokens were hits
        (prefix hit rate = hit tokens / query tokens, as vLLM reports it)."""
        _check_non_negative(prompt=prompt, generated=generated, cached=cached)
        if cached > prompt:
            raise ValueError(f"cached ({cached}) cannot exceed prompt ({prompt})")
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.prefix_queries.inc(prompt)
        self.prefix_hits.inc(cached)

    def set_queue(self, depth: int, inflight: int) -> None:
        self.queue_depth.set(depth)
        self.inflight.set(inflight)

    def set_worker(
        self, worker_id: str, role: str, up: bool, num_blocks: int, num_free_blocks: int,
        step_token_budget: int = 0,
    ) -> None:
        """Health, KV capacity and step budget of one worker (prefill workers report their own
        pool)."""
        self.worker_up.labels(worker_id, role).set(1 if up else 0)
        self.step_token_budget.labels(worker_id).set(step_token_budget)
        self.kv_blocks_total.labels(worker_id).set(num_blocks)
        self.kv_blocks_free.labels(worker_id).set(num_free_blocks)
        used = num_blocks - num_free_blocks
        self.kv_usage.labels(worker_id).set(used / num_blocks if num_blocks > 0 else 0.0)

    def remove_worker(self, worker_id: str) -> None:
        """Drop every series of a worker that left (so dashboards don't show it frozen)."""
        self.worker_up.remove_by_labels({"worker": worker_id})
        for gauge in (self.kv_blocks_total, self.kv_blocks_free, self.kv_usage,
                      self.step_token_budget):
            gauge.remove(worker_id)
        self.speculation.remove(worker_id)
        self.kv_tiers.remove(worker_id)

    def set_redis_up(self, up: bool) -> None:
        self.redis_up.set(1 if up else 0)

    def set_planner_desired(self, role: str, count: int) -> None:
        self.planner_desired.labels(role=role).set(count)

    # -- exposition ---------------------------------------------------------------------------

    def add_source(self, source: Callable[[], Sequence[str]]) -> None:
        """Merge in other router processes' metrics: `source()` returns their current
        expositions (Prometheus text), called on every render and scrape (from any thread)."""
        self._sources.append(source)

    def render(self) -> bytes:
        """The registry, merged with the sources', in Prometheus text exposition format."""
        return generate_latest(self.view)

    def start_http(self, host: str = defaults.HOST, port: int = 0) -> int:
        """Serve /metrics on host:port in a daemon thread; port 0 picks a free port.
        Returns the bound port."""
        if self._server is not None:
            raise RuntimeError("metrics HTTP server already started; call stop_http() first")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.view)
        bound = self._server.server_port
        logger.info("metrics served on http://%s:%d/metrics", host, bound)
        return bound

    def stop_http(self) -> None:
        """Stop the HTTP endpoint (no-op when not started)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server, self._thread = None, None


class _ServiceView:
    """A collector: the router's own registry, merged with its sources' expositions."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator:
        own = self.metrics.registry
        texts = [text for source in self.metrics._sources for text in source()]
        if not texts:  # one router process: its registry as it is
            yield from own.collect()
            return
        yield from merge_families(parse(generate_latest(own).decode()),
                                  [parse(text) for text in texts])
