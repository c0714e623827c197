"""PrefixIndexPublisher: keeps this worker's set in the Redis prefix index equal to its cache.

The index is one SET per worker and tier of raw block hashes (the key schema:
`pdserve.redis_keys`): `{namespace}:prefix:{worker_id}` for its device pool, and with KV tiers
(engine.kv_tiers) `...:host` and `...:disk` for what it holds below it. A daemon thread owns
a synchronous Redis client and applies, in order, what the worker's loop thread hands it; the
loop thread never waits on Redis.

Protocol (everything below runs on the thread that owns the BlockPool, so the event stream
and the snapshots are cut from one consistent sequence):

    pool.enable_events(); tiers.enable_events()     # tiers: the KV tiers, if any
    publisher = PrefixIndexPublisher(url, password, namespace, worker_id)
    ...  # every loop iteration, idle ones included:
    publisher.publish(*pool.drain_events())        # (stored, evicted), net since last drain
    for tier, (stored, evicted) in tiers.drain_events().items():
        publisher.publish(stored, evicted, tier)   # the same, for a tier under the pool
    if publisher.needs_snapshot:                   # everything held right now, every tier
        publisher.snapshot(pool.cached_hashes(), tiers.hashes())

- `publish` and `snapshot` only enqueue (copies); they never block and never raise.
- The thread applies a snapshot as DEL + SADD in one MULTI, every tier's set at once (a tier the
  snapshot does not name is emptied): the sets become exactly the snapshot. It applies an
  event batch as SREM evicted, then SADD stored, but only while the sets are in sync, i.e. a
  snapshot (and every batch since) was applied. Batches queued out of sync are dropped: the
  next snapshot supersedes them.
- The publisher raises `needs_snapshot` when it starts, once Redis answers again after any
  failure (it retries with backoff, 0.2 s doubling to 2 s, dropping what is queued meanwhile),
  and when the server restarted behind its back (its `run_id` changed; checked every
  `check_interval_s`). A restarted worker therefore replaces a stale set, and an emptied Redis
  is refilled. A snapshot that arrives unasked is applied too: any snapshot is a valid
  starting point for the batches queued after it.

`close()` applies what is already queued (if Redis answers), stops the thread within a
bounded join and deletes nothing: the router only asks about workers it knows are alive.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.redis_keys import PREFIX_TIERS, prefix_key

logger = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 2.0
_MAX_ITEMS_PER_APPLY = 256
_SADD_CHUNK = 10_000


@dataclass(frozen=True)
class _Events:
    key: str
    stored: list[bytes]
    evicted: list[bytes]


@dataclass(frozen=True)
class _Snapshot:
    hashes: dict[str, list[bytes]]  # key -> every hash of that set


_CLOSE = object()


class PrefixIndexPublisher:
    def __init__(
        self,
        url: str,
        password: str | None,
        namespace: str,
        worker_id: str,
        timeout_s: float = 0.5,
        check_interval_s: float = 1.0,
    ) -> None:
        if not namespace:
            raise ValueError("namespace must be non-empty (it prefixes every key)")
        if not worker_id:
            raise ValueError("worker_id must be non-empty (it names the worker's set)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if check_interval_s <= 0:
            raise ValueError(f"check_interval_s must be > 0, got {check_interval_s}")
        self.keys = {tier: prefix_key(namespace, worker_id, tier) for tier in PREFIX_TIERS}
        self.key = self.keys["device"]
        self.timeout_s = timeout_s
        self.check_interval_s = check_interval_s
        pool = redis.ConnectionPool.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # retrying is this class's job, with backoff
        )
        if password is not None:  # the explicit argument wins over a password in the URL
            pool.connection_kwargs["password"] = password
        self._client = redis.Redis(connection_pool=pool)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._needs_snapshot = False
        self._synced = False
        self._healthy: bool | None = None  # None until the first answer or failure
        self._run_id: str | None = None
        self._last_check = 0.0
        self._closed = False
        self._stop = threading.Event()
        self.num_snapshots = 0  # applied ones
        self._thread = threading.Thread(
            target=self._run, name=f"prefix-index-{worker_id}", daemon=True
        )
        self._thread.start()

    @property
    def needs_snapshot(self) -> bool:
        """The owner should call `snapshot(all cached hashes)` from its loop thread."""
        return self._needs_snapshot

    @property
    def healthy(self) -> bool:
        """Redis answered last time (False before the first contact and while retrying)."""
        return bool(self._healthy)

    @property
    def synced(self) -> bool:
        """The set mirrors the owner's cache as of the last update applied."""
        return self._synced

    def publish(self, stored: Sequence[bytes], evicted: Sequence[bytes],
                tier: str = "device") -> None:
        """Enqueue one drain's net events of one tier (applied as SREM evicted, then SADD
        stored)."""
        if (stored or evicted) and not self._closed:
            self._queue.put(_Events(self.keys[tier], list(stored), list(evicted)))

    def snapshot(self, hashes: Sequence[bytes],
                 tiers: dict[str, Sequence[bytes]] | None = None) -> None:
        """Enqueue the full set of hashes the owner holds now: `hashes` in its device pool,
        `tiers` below it (by tier; a tier not named holds none). Clears `needs_snapshot`."""
        if self._closed:
            return
        self._needs_snapshot = False  # before the put: a request raised after it is kept
        held = {"device": hashes, **(tiers or {})}
        self._queue.put(_Snapshot({key: list(held.get(tier, ())) for tier, key
                                   in self.keys.items()}))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_CLOSE)
        self._stop.set()
        self._thread.join(timeout=max(2.0, 4 * self.timeout_s))
        if self._thread.is_alive():
            logger.warning("prefix index publisher for %s did not stop in time", self.key)
        self._client.close()

    def _run(self) -> None:
        try:
            if not self._recover():
                return
            while True:
                items, closing = self._take()
                try:
                    self._apply(items)
                    if time.monotonic() - self._last_check >= self.check_interval_s:
                        self._check()
                except Exception as exc:  # any Redis trouble: resync once it answers
                    self._mark(False, exc)
                    if closing or not self._recover():
                        return
                    continue
                if closing:
                    return
        except Exception:  # a bug here must not take the worker down; the index goes stale
            logger.exception("prefix index publisher for %s failed", self.key)

    def _take(self) -> tuple[list[object], bool]:
        """Wait until the next check for a first item, then take what else is queued."""
        wait = self._last_check + self.check_interval_s - time.monotonic()
        items: list[object] = []
        try:
            items.append(self._queue.get(timeout=max(wait, 0.001)))
            while len(items) < _MAX_ITEMS_PER_APPLY:
                items.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        for i, item in enumerate(items):
            if item is _CLOSE:
                return items[:i], True
        return items, False

    def _apply(self, items: list[object]) -> None:
        synced = self._synced
        num_snapshots = 0
        with self._client.pipeline(transaction=True) as pipe:
            for item in items:
                if isinstance(item, _Snapshot):
                    for key, hashes in item.hashes.items():
                        pipe.delete(key)
                        for start in range(0, len(hashes), _SADD_CHUNK):
                            pipe.sadd(key, *hashes[start : start + _SADD_CHUNK])
                    synced, num_snapshots = True, num_snapshots + 1
                elif isinstance(item, _Events) and synced:
                    if item.evicted:
                        pipe.srem(item.key, *item.evicted)
                    if item.stored:
                        pipe.sadd(item.key, *item.stored)
            if num_snapshots:
                # read before writing: a restart in between shows as a changed id, never hides
                self._run_id = self._server_run_id()
                self._last_check = time.monotonic()
            if len(pipe):
                pipe.execute()
        self._synced = synced
        self.num_snapshots += num_snapshots

    def _check(self) -> None:
        self._last_check = time.monotonic()
        run_id = self._server_run_id()
        if self._run_id is not None and run_id != self._run_id and self._synced:
            logger.info("redis restarted under %s (run_id changed): re-snapshotting", self.key)
            self._synced = False
            self._needs_snapshot = True
        self._run_id = run_id

    def _server_run_id(self) -> str | None:
        return self._client.info("server").get("run_id")

    def _recover(self) -> bool:
        """Until Redis answers (backoff; queued items dropped), then ask for a snapshot.

        False if closed meanwhile.
        """
        self._synced = False
        delay = BACKOFF_MIN_S
        while True:
            self._drop_queued()
            if self._stop.is_set():
                return False
            try:
                self._client.ping()
                break
            except Exception as exc:
                self._mark(False, exc)
            if self._stop.wait(delay):
                return False
            delay = min(delay * 2, BACKOFF_MAX_S)
        self._mark(True)
        self._needs_snapshot = True  # after the drop: the snapshot answering it is kept
        return True

    def _drop_queued(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def _mark(self, healthy: bool, exc: BaseException | None = None) -> None:
        if healthy and self._healthy is not True:
            logger.info("prefix index publisher for %s: redis reachable", self.key)
        elif not healthy and self._healthy is not False:
            logger.warning("prefix index publisher for %s: redis unavailable (%r); retrying "
                           "with backoff, will re-snapshot", self.key, exc)
        self._healthy = healthy
