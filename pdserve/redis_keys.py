"""The Redis key schema, shared by its writers (workers) and its reader (the router).

Every key lives under one namespace, so several deployments can share a Redis:

- `{ns}:session:{tenant}/{session_id}`: a HASH with `token_ids` (a JSON list of ints) and
  `decode_worker`; its TTL is reset on every put (`router.store.RedisStore`). `tenant` is
  the caller's API-token namespace (`router.auth.tenant_of`; `public` without tokens): the
  fronts scope every client-given session id with it, so clients never share a session id.
- `{ns}:sessions:{tenant}`: a ZSET of that tenant's session keys scored by last use, which
  bounds how many sessions one tenant keeps (the least recently used go first).
- `{ns}:prefix:{worker_id}`: a SET of the raw 16-byte block hashes the worker holds. Together
  the per-worker sets are the cluster's block-hash -> workers index: a block is held by the
  workers whose set contains it. Each prefill worker keeps its own set current
  (`prefill_worker.prefix_events.PrefixIndexPublisher`); the router only reads.
- `{ns}:prefix:{worker_id}:host`, `...:disk`: the same, for the blocks it holds in its KV tiers
  below the device pool (engine.kv_tiers), which the router prices by tier.
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "pdserve"
PUBLIC_TENANT = "public"  # every caller, when the API has no tokens


def scoped_session_id(tenant: str, session_id: str) -> str:
    """A client's session id inside its tenant's namespace ("" stays "": no session)."""
    if not tenant or "/" in tenant:
        raise ValueError(f"tenant must be non-empty without '/', got {tenant!r}")
    return f"{tenant}/{session_id}" if session_id else ""


def session_tenant(session_id: str) -> str:
    """The tenant of a scoped session id (PUBLIC_TENANT for an unscoped one)."""
    tenant, sep, _ = session_id.partition("/")
    return tenant if sep else PUBLIC_TENANT


def session_key(namespace: str, session_id: str) -> str:
    return f"{namespace}:session:{session_id}"


def sessions_index_key(namespace: str, tenant: str) -> str:
    return f"{namespace}:sessions:{tenant}"


PREFIX_TIERS = ("device", "host", "disk")  # where a worker holds a prefix block


def prefix_key(namespace: str, worker_id: str, tier: str = "device") -> str:
    """The set of block hashes a worker holds in one tier: its device pool, or below it, in
    host memory or on disk (engine.kv_tiers)."""
    if tier not in PREFIX_TIERS:
        raise ValueError(f"tier must be one of {PREFIX_TIERS}, got {tier!r}")
    return f"{namespace}:prefix:{worker_id}" + ("" if tier == "device" else f":{tier}")


def lora_adapters_key(namespace: str) -> str:
    """The LoRA adapters the deployment's routers serve: a hash of name -> [id, path]."""
    return f"{namespace}:lora_adapters"
