"""The decode workers' speculative decoding counts, exported by the router as Prometheus counters.

A decode worker counts, since it started, its verifications (one sequence's drafts checked in
one step), the draft tokens verified and those accepted; the router reads them with its load
(proto/worker.proto WorkerLoad) and exports each worker's as one series, like the KV gauges
(label `worker`). A restarted worker counts from 0 again: a counter reset, which `rate()` and
`increase()` handle. Acceptance rate = increase(accepted) / increase(draft tokens); mean
accepted length = (increase(accepted) + increase(verifications)) / increase(verifications),
the tokens one verification emits (the target's own token included), as vLLM reports it.
Every router process sees the same workers, so the service's /metrics shows the service
process's copy, never a sum over router processes (metrics_merge.WORKER_COUNTERS).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily

logger = logging.getLogger(__name__)

# family name (exposed with `_total`) -> help; in the order `set` takes the counts
SPEC_COUNTERS: dict[str, str] = {
    "pdserve_spec_verifications": "Speculative verifications of a decode worker (one "
                                  "sequence's draft tokens checked in one step).",
    "pdserve_spec_draft_tokens": "Draft tokens a decode worker verified.",
    "pdserve_spec_accepted_tokens": "Draft tokens a decode worker accepted.",
}


class SpeculationCounters:
    """A collector: the last counts each decode worker reported (set on the router's loop,
    read by the metrics thread)."""

    def __init__(self) -> None:
        self._counts: dict[str, tuple[int, int, int]] = {}
        self._lock = threading.Lock()

    def set(self, worker_id: str, num_verifications: int, num_draft_tokens: int,
            num_accepted_tokens: int) -> None:
        with self._lock:
            self._counts[worker_id] = (num_verifications, num_draft_tokens, num_accepted_tokens)

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._counts.pop(worker_id, None)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:
            counts = sorted(self._counts.items())
        for i, (name, help_text) in enumerate(SPEC_COUNTERS.items()):
            family = CounterMetricFamily(name, help_text, labels=["worker"])
            for worker_id, values in counts:
                family.add_metric([worker_id], values[i])
            yield family
