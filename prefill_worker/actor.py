"""PrefillActor: one prefill worker as a Ray actor (the launcher wraps it with `ray.remote`).

The actor only hosts the worker: requests reach it over its gRPC service (`address`), never
through Ray calls, so the data and control planes stay as they are outside Ray. Ray calls are
for placement and supervision: `ping` is the liveness probe. The engine sets its own thread
count from the spec (ModelRunner applies `num_threads`). The cluster secret and the Redis
password come from the actor's environment (the pool's runtime_env), never its arguments.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pdserve import defaults
from pdserve.cluster_secret import ClusterSecret
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)


class PrefillActor:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.given = spec
        self.spec = WorkerSpec.from_dict(spec).with_resolved_host()
        self.secret = ClusterSecret.from_env()
        self.service = PrefillService(self.spec, self.secret,
                                      os.environ.get(defaults.REDIS_PASSWORD_ENV))

    def identity(self, challenge: str) -> dict[str, Any]:
        """What an owner adopting this worker checks (`Worker.adopt`): the spec it was started
        with and the challenge signed with its cluster secret."""
        return {"spec": self.given, "proof": self.secret.sign("adopt", challenge)}

    def address(self) -> str:
        return self.service.address

    def ping(self) -> str:
        """The gRPC address while the engine loop runs; raises once it has died."""
        if not self.service.worker.is_alive():
            raise RuntimeError(f"prefill worker {self.spec.worker_id}: engine loop has stopped")
        return self.service.address

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self.service.stop()
        logger.info("prefill worker %s stopped", self.spec.worker_id)
