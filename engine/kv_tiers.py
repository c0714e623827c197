"""KVTiers: which prefix blocks live below the device pool, and the copies that move them.

Two tiers sit under the device's BlockPool: host memory (a fixed number of block-sized slots)
and local disk (one file per block). Both are keyed by the device pool's block hash, whose chain
is rooted at the request's LoRA adapter, and both belong to one engine, so one model, dtype and
layout (the disk files also carry a layout id: engine.kv_offload).

Scheduler side only: this decides, the runner's KVOffload copies. No torch, no I/O.

- **Store (device -> host), write-through.** Each block the device pool publishes is copied to a
  host slot unless the host holds it already. The copy runs off the step's thread; until the
  runner says it landed, the tier holds a reference on the device block, so the pool can neither
  evict nor reuse it.
- **Demote (host -> disk).** A host slot taken back from its least recently used block first
  writes that block to disk (if the disk lacks it); a full disk drops its own oldest block.
- **Load (host -> device).** A prefix hit in the host continues the device's hits: the request
  gets fresh device blocks, copied from host layer by layer beside the step's forward (each
  layer waits for its own: engine.kv_layer_loads).
- **Promote (disk -> host).** A hit on disk is read (and checked) into a host slot off the step's
  thread; the request waits in the queue until it has landed, then loads from host. A file that
  fails its check is a miss: the request recomputes those tokens.

With `enable_events()` the tiers record which hashes became hits and which left, per tier, for
the cluster's prefix index (as engine.block_pool does for the device): `drain_events()`.

An entry is only a hit once the runner has confirmed its copy (`ready`); an entry whose copy is
in flight is never evicted, and a slot is never written while a copy reads it (the runner's
copy thread runs a plan's demotions, stores, promotions and deletes, in that order, each kind in
FIFO order, after that plan's loads have landed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from pdserve.engine.block_hash import BlockHash
from pdserve.engine.block_pool import Block, BlockPool

logger = logging.getLogger(__name__)

Tokens = tuple[int, ...]
TIERS = ("host", "disk")


@dataclass(frozen=True)
class TierOps:
    """The copies one step's runner starts (engine.kv_offload), in the order they run."""

    loads: tuple[tuple[int, int], ...] = ()  # (host slot, device block): beside the forward
    demotions: tuple[tuple[int, BlockHash, Tokens], ...] = ()  # (host slot, hash, tokens)
    stores: tuple[tuple[int, int], ...] = ()  # (device block, host slot)
    promotions: tuple[tuple[BlockHash, Tokens, int], ...] = ()  # (hash, tokens, host slot)
    deletes: tuple[BlockHash, ...] = ()  # disk files to drop

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class TierResults:
    """Copies the runner finished since it last reported."""

    stored: tuple[int, ...] = ()  # host slots now holding their block
    demoted: tuple[BlockHash, ...] = ()  # written to disk
    promoted: tuple[BlockHash, ...] = ()  # read back from disk into their host slot
    failed_stores: tuple[int, ...] = ()  # host slots whose copy failed (their entry goes)
    failed_demotions: tuple[BlockHash, ...] = ()  # the write failed (disk full, I/O error)
    failed_promotions: tuple[BlockHash, ...] = ()  # missing, torn, corrupt or foreign file


@dataclass
class TierStats:
    """Cumulative counts, in blocks."""

    host_hits: int = 0  # prefix blocks loaded from host instead of recomputed
    disk_hits: int = 0  # prefix blocks promoted from disk and then loaded
    stores: int = 0
    demotions: int = 0
    promotions: int = 0
    failed_promotions: int = 0
    evictions: int = 0  # blocks that left the last tier


@dataclass
class _Entry:
    token_ids: Tokens
    slot: int = -1  # host only
    ready: bool = False  # its bytes are in place (the runner confirmed the copy)
    promoting: bool = False  # host only: being read from disk


@dataclass(frozen=True)
class TierHit:
    """Where a prefix continues below the device: host slots to load, in chain order, and
    whether more of it is on its way up from disk (then the request should wait)."""

    host_slots: tuple[int, ...] = ()
    promoting: bool = False


@dataclass
class _Pending:
    loads: list[tuple[int, int]] = field(default_factory=list)
    demotions: list[tuple[int, BlockHash, Tokens]] = field(default_factory=list)
    stores: list[tuple[int, int]] = field(default_factory=list)
    promotions: list[tuple[BlockHash, Tokens, int]] = field(default_factory=list)
    deletes: list[BlockHash] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


class KVTiers:
    def __init__(self, pool: BlockPool, num_host_slots: int, num_disk_blocks: int = 0) -> None:
        if num_host_slots < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_host_slots}")
        self._pool = pool  # the tiers hold references on device blocks being stored
        self.num_host_slots = num_host_slots
        self.num_disk_blocks = num_disk_blocks
        self._host: OrderedDict[BlockHash, _Entry] = OrderedDict()  # least recent first
        self._disk: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._free_slots = list(range(num_host_slots - 1, -1, -1))
        self._slot_hash: dict[int, BlockHash] = {}
        self._storing: dict[int, Block] = {}  # host slot -> the device block it copies
        self._pending = _Pending()
        self._in_flight = 0  # ops handed to the runner, not yet confirmed
        self.stats = TierStats()
        # per tier: hash -> True (a hit now) / False (gone), the last event wins; None: off
        self._events: dict[str, dict[BlockHash, bool]] | None = None

    @property
    def busy(self) -> bool:
        """Copies decided or running: the engine must step (or flush) until they land."""
        return self._in_flight > 0 or bool(self._pending)

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    @property
    def num_disk_blocks_held(self) -> int:
        return len(self._disk)

    # ---- the device pool's side ----

    def on_cached(self, block: Block) -> None:
        """The device pool published `block`: write it through to host memory."""
        assert block.block_hash is not None
        entry = self._host.get(block.block_hash)
        if entry is not None:
            self._host.move_to_end(block.block_hash)
            return
        slot = self._take_slot()
        if slot is None:  # every slot is mid-copy: this block is not kept below the device
            return
        self._pool.touch([block])  # released when the store lands
        self._storing[slot] = block
        self._put_host(block.block_hash, _Entry(block.token_ids, slot))
        self._pending.stores.append((block.block_id, slot))

    def match(self, hashes: Sequence[BlockHash], token_chunks: Sequence[Sequence[int]],
              promote: bool = True) -> TierHit:
        """The chain's blocks after the device's hits: host hits (in order, from the first),
        then disk hits, whose promotion starts now (unless not `promote`: a caller that will
        not wait for them). Host hits become the most recently used; `load` copies them once
        the request has device blocks."""
        slots: list[int] = []
        for block_hash, tokens in zip(hashes, token_chunks):
            entry = self._host.get(block_hash)
            if entry is None or entry.token_ids != tuple(tokens):
                break
            if not entry.ready:
                return TierHit(tuple(slots), promoting=entry.promoting)
            self._host.move_to_end(block_hash)
            slots.append(entry.slot)
        n = len(slots)
        if n == len(hashes) or not promote:
            return TierHit(tuple(slots))
        return TierHit(tuple(slots), self._promote(hashes[n:], token_chunks[n:], set(hashes)))

    def load(self, host_slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy these host slots into these fresh device blocks before the next forward."""
        for slot, block_id in zip(host_slots, block_ids, strict=True):
            self._host.move_to_end(self._slot_hash[slot])
            self._pending.loads.append((slot, block_id))
        self.stats.host_hits += len(host_slots)

    def cancel_loads(self, block_ids: Sequence[int]) -> None:
        """These device blocks were freed before their loads ran: drop the loads (the blocks
        may be someone else's by the time the next step starts)."""
        freed = set(block_ids)
        self._pending.loads = [(s, b) for s, b in self._pending.loads if b not in freed]

    def adopt_disk(self, blocks: Sequence[tuple[BlockHash, Tokens]]) -> None:
        """Blocks found on disk at start (oldest first): the newest that fit are hits from now
        on, the files of the others go (capacity holds across a restart)."""
        drop = max(len(blocks) - self.num_disk_blocks, 0)
        self._pending.deletes += [block_hash for block_hash, _ in blocks[:drop]]
        for block_hash, tokens in blocks[drop:]:
            self._disk[block_hash] = _Entry(tuple(tokens), ready=True)
            self._record("disk", block_hash, True)
        logger.info("disk tier: %d blocks adopted, %d over capacity dropped",
                    len(blocks) - drop, drop)

    def enable_events(self) -> None:
        """Start recording (a snapshot, `hashes()`, covers what came before)."""
        if self._events is None:
            self._events = {tier: {} for tier in TIERS}

    def drain_events(self) -> dict[str, tuple[list[BlockHash], list[BlockHash]]]:
        """Per tier, (became hits, left) since the last drain, net: as BlockPool's."""
        if self._events is None:
            return {}
        events, self._events = self._events, {tier: {} for tier in TIERS}
        return {tier: ([h for h, hit in e.items() if hit], [h for h, hit in e.items() if not hit])
                for tier, e in events.items() if e}

    def hashes(self) -> dict[str, list[BlockHash]]:
        """Per tier, every hash that is a hit now."""
        return {"host": [h for h, e in self._host.items() if e.ready],
                "disk": [h for h, e in self._disk.items() if e.ready]}

    def _record(self, tier: str, block_hash: BlockHash, hit: bool) -> None:
        if self._events is not None:
            self._events[tier].pop(block_hash, None)
            self._events[tier][block_hash] = hit

    # ---- the runner's side ----

    def take_ops(self) -> TierOps:
        """What the next step's runner copies; the tier waits for its results."""
        p, self._pending = self._pending, _Pending()
        ops = TierOps(tuple(p.loads), tuple(p.demotions), tuple(p.stores),
                      tuple(p.promotions), tuple(p.deletes))
        self._in_flight += len(ops.demotions) + len(ops.stores) + len(ops.promotions)
        return ops

    def apply(self, results: TierResults) -> None:
        """Copies that landed (or failed) become hits (or misses)."""
        self._in_flight -= sum(map(len, (
            results.stored, results.demoted, results.promoted, results.failed_stores,
            results.failed_demotions, results.failed_promotions)))
        assert self._in_flight >= 0, "the runner confirmed a copy twice"
        for slot in results.stored:
            self._pool.release([self._storing.pop(slot)])
            self._host[self._slot_hash[slot]].ready = True
            self._record("host", self._slot_hash[slot], True)
            self.stats.stores += 1
        for slot in results.failed_stores:
            self._pool.release([self._storing.pop(slot)])
            self._drop_host(self._slot_hash[slot])
        for block_hash in results.demoted:
            self._disk[block_hash].ready = True
            self._record("disk", block_hash, True)
            self.stats.demotions += 1
        for block_hash in results.failed_demotions:
            self._drop_disk(block_hash)
        for block_hash in results.promoted:
            entry = self._host[block_hash]
            entry.ready, entry.promoting = True, False
            self._record("host", block_hash, True)
            self.stats.promotions += 1
        for block_hash in results.failed_promotions:  # the file is gone: a miss from now on
            self._drop_host(block_hash)
            self._drop_disk(block_hash)
            self.stats.failed_promotions += 1

    # ---- inside ----

    def _promote(self, hashes: Sequence[BlockHash], token_chunks: Sequence[Sequence[int]],
                 chain: set[BlockHash]) -> bool:
        """Start reading the chain's disk hits (from its first block on) into host slots
        that hold none of the `chain`'s blocks; whether any is on its way. A chain longer
        than the host tier stops where the host is full of it: the rest is recomputed."""
        started = False
        for block_hash, tokens in zip(hashes, token_chunks):
            entry = self._disk.get(block_hash)
            if entry is None or not entry.ready or entry.token_ids != tuple(tokens):
                break
            if block_hash in self._host:  # already on its way up
                started = True
                continue
            slot = self._take_slot(keep=chain)
            if slot is None:
                break
            self._disk.move_to_end(block_hash)
            self._put_host(block_hash, _Entry(entry.token_ids, slot, promoting=True))
            self._pending.promotions.append((block_hash, entry.token_ids, slot))
            self.stats.disk_hits += 1
            started = True
        return started

    def _put_host(self, block_hash: BlockHash, entry: _Entry) -> None:
        self._host[block_hash] = entry
        self._slot_hash[entry.slot] = block_hash

    def _drop_host(self, block_hash: BlockHash) -> None:
        entry = self._host.pop(block_hash)
        del self._slot_hash[entry.slot]
        self._free_slots.append(entry.slot)
        self._record("host", block_hash, False)

    def _drop_disk(self, block_hash: BlockHash) -> None:
        if self._disk.pop(block_hash, None) is not None:
            self._record("disk", block_hash, False)

    def _take_slot(self, keep: set[BlockHash] | None = None) -> int | None:
        """A free host slot, else the least recently used ready one's (demoted to disk),
        never one holding a block of `keep`; None when there is none."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, e in self._host.items() if e.ready and h not in (keep or ())),
                      None)
        if victim is None:
            return None
        entry = self._host[victim]
        self._drop_host(victim)
        self._demote(victim, entry)
        return self._free_slots.pop()  # the victim's

    def _demote(self, block_hash: BlockHash, entry: _Entry) -> None:
        """The host lets go of a block: keep it on disk, if there is a disk and room."""
        if not self.num_disk_blocks or block_hash in self._disk:
            self.stats.evictions += block_hash not in self._disk
            return
        if len(self._disk) >= self.num_disk_blocks:
            oldest = next((h for h, e in self._disk.items() if e.ready), None)
            if oldest is None:
                self.stats.evictions += 1
                return
            self._drop_disk(oldest)
            self._pending.deletes.append(oldest)
            self.stats.evictions += 1
        self._disk[block_hash] = _Entry(entry.token_ids)
        self._pending.demotions.append((entry.slot, block_hash, entry.token_ids))
