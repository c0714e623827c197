"""RedisStore: the router's shared state in Redis (sessions, prefix index), fail-open.

The keys are `pdserve.redis_keys`' (sessions, which this store reads and writes, and the
workers' prefix sets, which it only reads).

Redis is advisory here, never on the critical path: every call is bounded by `timeout_s` and
answers "unknown" (None, {}, nothing done) on any Redis trouble, so routing falls back to
load-only. Health flips (and is logged) only on transitions; any successful call, or the
periodic `check()`, brings it back.

Session policy (a session is a routing hint, never state a request depends on):
- Owned by a tenant: session ids arrive scoped by the front as `<tenant>/<client's id>`
  (`pdserve.redis_keys.scoped_session_id`, the tenant is the hash of the caller's API token),
  so a client can neither read nor overwrite another token's session, whatever id it sends.
- Bounded in size: at most `session_max_tokens` tokens of history are kept, the *leading*
  ones: the history is only ever matched as a prefix of the next turn's prompt (what the
  session's decode worker still holds), so the oldest tokens are the useful ones.
- Bounded in count: each tenant keeps at most `max_sessions_per_tenant` sessions; a put that
  goes past it drops that tenant's least recently used ones (one atomic script).
- Bounded in time: a session expires `session_ttl_s` after its last turn.
Beyond that the bundled Redis evicts least recently used keys at its `maxmemory`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve import redis_keys
from pdserve.engine.lora_request import LoRARequest
from pdserve.router.policy import TierHits, leading_tier_hits

logger = logging.getLogger(__name__)

T = TypeVar("T")


# KEYS: the session, its tenant's index. ARGV: token_ids, decode_worker, ttl_s, now_ms, cap.
# The session is written, then the index drops expired entries and, past the cap, the least
# recently used sessions (their keys with them). Returns how many were dropped for the cap.
_PUT_SESSION = """
redis.call('HSET', KEYS[1], 'token_ids', ARGV[1], 'decode_worker', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
local now = tonumber(ARGV[4])
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]) * 1000)
local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if extra > 0 then
  local oldest = redis.call('ZPOPMIN', KEYS[2], extra)
  for i = 1, #oldest, 2 do redis.call('DEL', oldest[i]) end
else
  extra = 0
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
return extra
"""


@dataclass(frozen=True)
class Session:
    token_ids: tuple[int, ...]
    decode_worker: str


class RedisStore:
    def __init__(
        self,
        url: str,
        password: str | None = None,
        namespace: str = redis_keys.DEFAULT_NAMESPACE,
        timeout_s: float = 0.05,
        session_ttl_s: int = 3600,
        session_max_tokens: int = 16384,
        max_sessions_per_tenant: int = 10000,
    ) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty (it prefixes every key)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if session_ttl_s < 1:
            raise ValueError(f"session_ttl_s must be >= 1 second, got {session_ttl_s}")
        for name, value in (("session_max_tokens", session_max_tokens),
                            ("max_sessions_per_tenant", max_sessions_per_tenant)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.session_ttl_s = session_ttl_s
        self.session_max_tokens = session_max_tokens
        self.max_sessions_per_tenant = max_sessions_per_tenant
        pool = aioredis.ConnectionPool.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # a retry would outlive the caller's budget
        )
        if password is not None:  # the explicit argument wins over a password in the URL
            pool.connection_kwargs["password"] = password
        self._redis = aioredis.Redis(connection_pool=pool)
        self._put_session = self._redis.register_script(_PUT_SESSION)
        self._healthy = True

    @property
    def healthy(self) -> bool:
        """False since the last failed call, until a call (or `check()`) succeeds."""
        return self._healthy

    def session_key(self, session_id: str) -> str:
        return redis_keys.session_key(self.namespace, session_id)

    def prefix_key(self, worker_id: str, tier: str = "device") -> str:
        return redis_keys.prefix_key(self.namespace, worker_id, tier)

    async def check(self) -> bool:
        """PING; the router calls this every second or so, so health recovers without traffic."""
        return bool(await self._call("ping", self._redis.ping, False))

    async def get_session(self, session_id: str) -> Session | None:
        key = self.session_key(session_id)
        fields = await self._call("get_session", lambda: self._redis.hgetall(key), None)
        if not fields:
            return None
        try:
            token_ids = json.loads(fields[b"token_ids"])
            if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
                raise ValueError("token_ids is not a JSON list of ints")
            return Session(tuple(token_ids), fields[b"decode_worker"].decode())
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            logger.warning("ignoring malformed session %r: %s", key, exc)
            return None

    async def put_session(
        self, session_id: str, token_ids: Sequence[int], decode_worker: str
    ) -> None:
        """Record a session's history (its leading `session_max_tokens` tokens) and worker."""
        key = self.session_key(session_id)
        index = redis_keys.sessions_index_key(self.namespace,
                                              redis_keys.session_tenant(session_id))
        kept = json.dumps([int(t) for t in token_ids[:self.session_max_tokens]])
        args = [kept, decode_worker, self.session_ttl_s, int(time.time() * 1000),
                self.max_sessions_per_tenant]
        dropped = await self._call(
            "put_session", lambda: self._put_session(keys=[key, index], args=args), None)
        if dropped:
            logger.debug("session cap of %s: dropped %d least recently used", index, dropped)

    async def prefix_hits(
        self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]
    ) -> dict[str, TierHits]:
        """Per worker, how many LEADING `block_hashes` it holds (a hole stops the count), by
        the fastest tier holding each (device, or its KV tiers: host, disk).

        {} when either input is empty (Redis untouched) or Redis is unavailable; otherwise
        every worker id is a key, no hits included.
        """
        if not block_hashes or not worker_ids:
            return {}
        members = list(block_hashes)
        workers = list(dict.fromkeys(worker_ids))
        tiers = redis_keys.PREFIX_TIERS

        async def query() -> list[list[int]]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker_id in workers:
                    for tier in tiers:
                        pipe.smismember(self.prefix_key(worker_id, tier), members)
                return await pipe.execute()

        replies = await self._call("prefix_hits", query, None)
        if replies is None:
            return {}
        n = len(tiers)
        return {w: leading_tier_hits(dict(zip(tiers, replies[i * n:(i + 1) * n])))
                for i, w in enumerate(workers)}

    async def lora_adapters(self) -> dict[str, LoRARequest] | None:
        """The LoRA adapters the deployment serves (router.lora_adapters); None when Redis does
        not answer. A malformed entry is skipped."""
        key = redis_keys.lora_adapters_key(self.namespace)
        fields = await self._call("lora_adapters", lambda: self._redis.hgetall(key), None)
        if fields is None:
            return None
        table = {}
        for name, value in fields.items():
            try:
                lora_int_id, path = json.loads(value)
                lora = LoRARequest(name.decode(), lora_int_id, path)
            except (TypeError, ValueError, UnicodeDecodeError) as exc:
                logger.warning("ignoring malformed LoRA adapter entry %r: %s", name, exc)
                continue
            table[lora.lora_name] = lora
        return table

    async def put_lora_adapter(self, lora: LoRARequest, only_new: bool = False) -> bool:
        """Record `lora` (`only_new`: unless its name is there already); False when Redis
        does not answer."""
        key = redis_keys.lora_adapters_key(self.namespace)
        value = json.dumps([lora.lora_int_id, lora.lora_path])
        put = self._redis.hsetnx if only_new else self._redis.hset
        return await self._call("put_lora_adapter", lambda: put(key, lora.lora_name, value),
                                None) is not None

    async def delete_lora_adapter(self, name: str) -> bool:
        key = redis_keys.lora_adapters_key(self.namespace)
        return await self._call("delete_lora_adapter", lambda: self._redis.hdel(key, name),
                                None) is not None

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except Exception as exc:  # closing must not fail the router's shutdown
            logger.debug("closing redis client: %s", exc)

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]], unknown: T) -> T:
        """Run one Redis operation within the budget; `unknown` on any failure."""
        try:
            result = await asyncio.wait_for(fn(), self.timeout_s)
        except Exception as exc:  # fail open: Redis trouble must never reach the serving path
            if self._healthy:
                logger.warning(
                    "redis unavailable during %s (%r): sessions and prefix routing fall back "
                    "until it answers again",
                    op,
                    exc,
                )
            self._healthy = False
            return unknown
        if not self._healthy:
            logger.info("redis reachable again (%s)", op)
        self._healthy = True
        return result

