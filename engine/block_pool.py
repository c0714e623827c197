"""BlockPool: owns every KV block's ref count, the free queue and the prefix-cache map.

Free blocks sit in one LRU queue, least recently freed first. A freed block keeps its hash
(it stays a prefix-cache hit) until allocation reuses it, which evicts the hash. No torch.

Optionally (`record_events=True` or `enable_events()`; off by default, so an offline engine
accumulates nothing) the pool records which hashes entered and left the cache, for the
cluster's prefix index. `drain_events()` returns the net effect since the last drain as two
disjoint lists, `(stored, evicted)`: applying "remove evicted, then add stored" to the set
as of the previous drain gives exactly the current cache (stored-then-evicted ends up evicted,
evicted-then-stored ends up stored). Pair it with `cached_hashes()` for a full snapshot.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.block_hash import BlockHash

logger = logging.getLogger(__name__)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # what the hash stands for: a hit is verified against it


class BlockPool:
    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # hash -> True (stored) / False (evicted), last event wins, in order of last event;
        # None while recording is off
        self._events: dict[BlockHash, bool] | None = {} if record_events else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references: truly empty ones plus evictable cached ones."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block(self, block_id: int) -> Block:
        return self._blocks[block_id]

    def allocate(self, count: int) -> list[Block]:
        """Take `count` blocks from the LRU end, evicting their cached hashes."""
        if count > len(self._free):
            raise ValueError(f"asked for {count} blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> Block | None:
        """The cached block for this hash if its stored tokens match exactly."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        return block if block.token_ids == tuple(token_ids) else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; unreferenced blocks join the free queue's MRU end.

        Callers pass a request's blocks tail first, so a sequence's last blocks are evicted
        before its (more shareable) first ones.
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} released twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Publish a full block under its hash; an identical block already cached wins.
        Whether `block` was published."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block.block_id
        if self._events is not None:
            self._record(block_hash, True)
        return True

    def enable_events(self) -> None:
        """Start recording stored/evicted events (hashes cached before are not replayed)."""
        if self._events is None:
            self._events = {}

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted) since the last drain, net: apply SREM evicted, then SADD stored."""
        if not self._events:
            return [], []
        events, self._events = self._events, {}
        stored = [h for h, is_stored in events.items() if is_stored]
        evicted = [h for h, is_stored in events.items() if not is_stored]
        return stored, evicted

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash currently in the prefix cache (a copy)."""
        return list(self._cached)

    def reset_prefix_cache(self) -> None:
        for block in self._blocks:
            self._evict(block)

    def _record(self, block_hash: BlockHash, stored: bool) -> None:
        assert self._events is not None
        self._events.pop(block_hash, None)  # re-insert: order follows the latest event
        self._events[block_hash] = stored

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self.num_evictions += 1
            if self._events is not None:
                self._record(block.block_hash, False)
        block.block_hash = None
        block.token_ids = ()
