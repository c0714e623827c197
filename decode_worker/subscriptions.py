"""OutputFanout: one decode worker's step batches, sorted per router (issue 17).

Several router processes share a decode worker, each with one `Outputs` stream (its
subscription, keyed by its `router_id`), and each must see only its own requests' deltas. One
thread here is the only reader of `worker.next_outputs`; it splits every step batch by the owner
recorded when Reserve / Submit accepted the request (`claim`, before the request is queued, so
its first delta already finds its owner), so a router still gets one message per engine step
and none for a step without its news. The owner is forgotten when the request's finishing
delta passes. A second subscription of one router replaces the first (that stream ends:
`End(replaced=True)`); deltas whose owner has no subscription now are dropped (that router
failed those requests itself when its stream broke).

Owner lease: a router that owns requests here and has had no subscription for
`orphan_after_s` (killed, or cut off) gets every one of them aborted, so their KV blocks come
back; a router that subscribes again within the grace keeps them. When the engine loop stops,
the last error deltas reach their owners first, then every subscription gets `End()`.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass

from pdserve.decode_worker.outputs import DecodeOutput
from pdserve.decode_worker.worker import DecodeWorker

logger = logging.getLogger(__name__)

# A live router whose stream broke subscribes again within router.workers.RECONNECT_S (0.5 s);
# one that is gone has its requests freed this long after (plus POLL_S): well within the
# few seconds a router's death may hold KV (issue 18: within 5 s on every worker).
ORPHAN_AFTER_S = 2.5
POLL_S = 0.1  # how often the fan-out looks at the loop's health and at orphaned routers
ROUTER_ID_MAX_CHARS = 64
_ROUTER_ID = re.compile(r"[A-Za-z0-9._:-]*")


def check_router_id(router_id: str) -> str:
    """`router_id` itself; ValueError naming the field unless it is at most 64 characters of
    [A-Za-z0-9._:-] (empty: a router that sends no id, one shared owner for all of those)."""
    if (not isinstance(router_id, str) or len(router_id) > ROUTER_ID_MAX_CHARS
            or not _ROUTER_ID.fullmatch(router_id)):
        raise ValueError(f"router_id must be at most {ROUTER_ID_MAX_CHARS} characters of "
                         f"A-Z a-z 0-9 . _ : - (e.g. 'router-3f9a1c2b'), got {router_id!r:.80}")
    return router_id


@dataclass(frozen=True)
class End:
    """A subscription is over: a newer one of its router replaced it, or the loop stopped."""

    replaced: bool = False


class Subscription:
    """One router's Outputs stream: its step batches, in order, then possibly an End."""

    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self._queue: queue.SimpleQueue[tuple[DecodeOutput, ...] | End] = queue.SimpleQueue()
        self._end: End | None = None  # met behind step batches: returned once they went out

    def next(self, timeout: float) -> list[tuple[DecodeOutput, ...]] | End:
        """Every step's deltas waiting for this router, oldest first (one step while it keeps
        up, more when it fell behind: they go out as one message, see coalesce), End once
        those before it went out, or [] after `timeout` seconds."""
        if self._end is not None:
            return self._end
        try:
            first = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        if isinstance(first, End):
            return first
        batches = [first]
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batches
            if isinstance(item, End):
                self._end = item
                return batches
            batches.append(item)

    def put(self, item: tuple[DecodeOutput, ...] | End) -> None:
        self._queue.put(item)


class OutputFanout:
    def __init__(self, worker: DecodeWorker, worker_id: str,
                 orphan_after_s: float = ORPHAN_AFTER_S, poll_s: float = POLL_S) -> None:
        if orphan_after_s <= 0:
            raise ValueError(f"orphan_after_s must be > 0 (seconds), got {orphan_after_s}")
        self.worker, self.worker_id = worker, worker_id
        self.orphan_after_s, self.poll_s = orphan_after_s, poll_s
        self._lock = threading.Lock()  # the tables below: gRPC threads and the fan-out thread
        self._owners: dict[str, str] = {}  # request id -> router id
        self._subscriptions: dict[str, Subscription] = {}  # router id -> its current one
        self._orphaned_since: dict[str, float] = {}  # router id (no subscription) -> monotonic
        self._ended = False
        self._thread = threading.Thread(target=self._run, name=f"outputs-{worker_id}",
                                        daemon=True)
        self._thread.start()

    # ---- gRPC threads ----

    def claim(self, request_id: str, router_id: str) -> bool:
        """Record the owner of a request about to be queued. False (nothing recorded) when the
        id has an owner already: the worker refuses a duplicate in flight, and the caller must
        not `release` the other request's owner."""
        with self._lock:
            if request_id in self._owners:
                return False
            self._owners[request_id] = router_id
            if router_id not in self._subscriptions:  # the lease runs from now
                self._orphaned_since.setdefault(router_id, time.monotonic())
            return True

    def release(self, request_id: str) -> None:
        """The claimed request was not accepted (refused or invalid): it has no owner."""
        with self._lock:
            self._owners.pop(request_id, None)

    def subscribe(self, router_id: str) -> Subscription:
        """A new Outputs stream of `router_id`; it replaces (ends) that router's previous one."""
        subscription = Subscription(router_id)
        with self._lock:
            if self._ended:
                subscription.put(End())
                return subscription
            old = self._subscriptions.get(router_id)
            if old is not None:
                old.put(End(replaced=True))
            self._subscriptions[router_id] = subscription
            self._orphaned_since.pop(router_id, None)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Its stream ended (idempotent): the router's lease starts unless it has a newer one."""
        with self._lock:
            if self._subscriptions.get(subscription.router_id) is subscription:
                del self._subscriptions[subscription.router_id]
                self._orphaned_since[subscription.router_id] = time.monotonic()

    def owned(self, router_id: str) -> int:
        """How many requests `router_id` owns here now."""
        with self._lock:
            return sum(owner == router_id for owner in self._owners.values())

    # ---- the fan-out thread ----

    def _run(self) -> None:
        try:
            while True:
                alive = self.worker.is_alive()  # before the read: a dead loop has put its last
                batch = self.worker.next_outputs(timeout=self.poll_s)
                if batch:
                    self._deliver(batch)
                elif not alive:  # ... and that was read: every error delta went out
                    return
                self._reap_orphans(time.monotonic())
        except Exception:  # a stream that never ends would hide the fault from every router
            logger.exception("decode worker %s: the output fan-out failed", self.worker_id)
        finally:
            self._end_all()

    def _deliver(self, batch: tuple[DecodeOutput, ...]) -> None:
        """Split one step batch by owner: one tuple per router with news this step."""
        by_router: dict[str, list[DecodeOutput]] = {}
        with self._lock:
            for out in batch:
                owner = self._owners.get(out.request_id)
                if owner is None:  # never claimed here: no router waits for it
                    logger.debug("decode worker %s: delta of unowned request %s dropped",
                                 self.worker_id, out.request_id)
                    continue
                if out.finished:
                    del self._owners[out.request_id]
                by_router.setdefault(owner, []).append(out)
            for router_id, outs in by_router.items():
                subscription = self._subscriptions.get(router_id)
                if subscription is not None:
                    subscription.put(tuple(outs))

    def _reap_orphans(self, now: float) -> None:
        """Abort the requests of every router past its lease (off this thread: an abort waits
        for the engine loop, and the other routers' deltas must not)."""
        with self._lock:
            due = [r for r, since in self._orphaned_since.items()
                   if now - since >= self.orphan_after_s]
            victims: dict[str, list[str]] = {r: [] for r in due}
            if due:
                for request_id, owner in self._owners.items():
                    if owner in victims:
                        victims[owner].append(request_id)
            for router_id, request_ids in victims.items():
                if request_ids:  # again after another lease: one claimed meanwhile is caught
                    self._orphaned_since[router_id] = now
                else:
                    del self._orphaned_since[router_id]
        for router_id, request_ids in victims.items():
            if request_ids:
                threading.Thread(target=self._abort_orphans, args=(router_id, request_ids),
                                 name=f"orphans-{self.worker_id}", daemon=True).start()

    def _abort_orphans(self, router_id: str, request_ids: list[str]) -> None:
        reason = f"router {router_id!r} has had no Outputs stream for {self.orphan_after_s:g} s"
        found = 0
        for request_id in request_ids:
            try:
                found += self.worker.abort(request_id, reason=reason)
            except RuntimeError:  # the loop stopped: it ended every request itself
                return
        if found:
            logger.warning("decode worker %s: router %r has had no Outputs stream for %g s: "
                           "aborted its %d requests", self.worker_id, router_id,
                           self.orphan_after_s, found)

    def _end_all(self) -> None:
        with self._lock:
            self._ended = True
            for subscription in self._subscriptions.values():
                subscription.put(End())
            self._subscriptions.clear()
