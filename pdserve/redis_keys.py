"""The Redis key schema, shared by its writers (workers) and its reader (the router).

Every key lives under one namespace, so several deployments can share a Redis:

- `{ns}:session:{session_id}`: a HASH with `token_ids` (a JSON list of ints) and
  `decode_worker`; its TTL is reset on every put (`router.store.RedisStore`).
- `{ns}:prefix:{worker_id}`: a SET of the raw 16-byte block hashes the worker holds. Together
  the per-worker sets are the cluster's block-hash -> workers index: a block is held by the
  workers whose set contains it. Each prefill worker keeps its own set current
  (`prefill_worker.prefix_events.PrefixIndexPublisher`); the router only reads.
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "pdserve"


def session_key(namespace: str, session_id: str) -> str:
    return f"{namespace}:session:{session_id}"


def prefix_key(namespace: str, worker_id: str) -> str:
    return f"{namespace}:prefix:{worker_id}"
