"""KVCacheManager: which blocks each request holds, prefix-cache hits, allocation and free.

The BlockPool owns ref counts and the free queue; this class owns the request -> blocks map
and each request's chain of block hashes. With tiers under the device pool (engine.kv_tiers)
a prefix continues from host memory or disk where the device's hits end. No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pdserve.engine.block_hash import BlockHash, chain_root, hash_blocks
from pdserve.engine.block_pool import Block, BlockPool
from pdserve.engine.kv_tiers import KVTiers, TierHit, TierOps
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.request import Request

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_host_blocks: int = 0, num_disk_blocks: int = 0) -> None:
        """`num_host_blocks`, `num_disk_blocks`: the tiers' capacities (0: no tiers)."""
        self.pool = BlockPool(num_blocks)
        self.tiers = (KVTiers(self.pool, num_host_blocks, num_disk_blocks)
                      if num_host_blocks and enable_prefix_caching else None)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already published

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def find_cached_prefix(self, request: Request, num_tokens: int | None = None) -> list[Block]:
        """Leading blocks of the request already cached (no reference taken yet), among its
        first `num_tokens` tokens (default: all of them; a remote reservation looks at its
        prompt only).

        At least the last token is always recomputed, so the sampler has its logits; for
        remote KV that is also what keeps a transfer from being empty. A request that still
        needs prompt logprobs takes no hit: each prompt position's logits must be computed.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []
        tokens = request.all_token_ids
        if num_tokens is not None:
            tokens = tokens[:num_tokens]
        hashes = self._chain(request, tokens)
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[Block] = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(block_hash, tokens[start : start + self.block_size])
            if block is None:
                break
            hits.append(block)
        return hits

    def find_tier_hit(self, request: Request, device_hits: Sequence[Block],
                      num_tokens: int | None = None, wait: bool = True) -> TierHit:
        """Where the request's prefix continues below the device, after `device_hits`
        (`find_cached_prefix`'s, among the same first `num_tokens` tokens): host slots to
        load, or disk blocks now on their way up (`promoting`: the request should wait; a
        caller that cannot, `wait=False`, starts no read from disk)."""
        if self.tiers is None or request.needs_prompt_logprobs:
            return TierHit()
        tokens = request.all_token_ids[:num_tokens]
        hashes = self._chain(request, tokens)
        first, end = len(device_hits), (len(tokens) - 1) // self.block_size
        chunks = [tokens[i * self.block_size:(i + 1) * self.block_size] for i in range(first, end)]
        return self.tiers.match(hashes[first:end], chunks, promote=wait)

    def allocate(
        self, request: Request, num_new_tokens: int, hits: Sequence[Block] = (),
        host_slots: Sequence[int] = (),
    ) -> bool:
        """Make room for `num_new_tokens` more tokens (after `hits`, then the blocks loaded
        from `host_slots`); False if the pool is short.

        On False nothing changes, so the caller may preempt and try again.
        """
        held = self._blocks.get(request.request_id, [])
        num_hit = len(hits) + len(host_slots)
        assert not (num_hit and held), "prefix hits apply only to a request holding no blocks"
        num_computed = num_hit * self.block_size if num_hit else request.num_computed_tokens
        need = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(hits)
        evictable_hits = sum(1 for b in hits if b.ref_count == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        self.pool.touch(hits)
        held = self._blocks.setdefault(request.request_id, [])
        held.extend(hits)
        fresh = self.pool.allocate(max(need, 0))
        held.extend(fresh)
        if host_slots:
            assert self.tiers is not None
            self.tiers.load(host_slots, [b.block_id for b in fresh[:len(host_slots)]])
        if hits:
            self._num_cached_blocks[request.request_id] = len(hits)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        tokens = request.token_slice(0, num_full * self.block_size)
        hashes = self._chain(request, tokens)
        blocks = self._blocks[request.request_id]
        for i in range(done, num_full):
            start = i * self.block_size
            if (self.pool.cache(blocks[i], hashes[i], tokens[start : start + self.block_size])
                    and self.tiers is not None):
                self.tiers.on_cached(blocks[i])
        self._num_cached_blocks[request.request_id] = num_full

    def hold_cached(self, token_ids: Sequence[int], lora: LoRARequest | None, first_block: int,
                    num_blocks: int) -> list[Block]:
        """Take a reference on blocks [first_block, first_block + num_blocks) of the prefix
        `token_ids` (run with `lora`), so nothing evicts or rewrites them while another worker
        reads them (`release_held` gives them back); LookupError, holding nothing, unless the
        device prefix cache holds every one."""
        size = self.block_size
        hashes = hash_blocks(token_ids, size, root=chain_root(lora))
        blocks = []
        for i in range(first_block, first_block + num_blocks):
            block = self.pool.lookup(hashes[i], token_ids[i * size:(i + 1) * size]) \
                if i < len(hashes) else None
            if block is None:
                raise LookupError(f"block {i} of the prefix is not in this worker's prefix "
                                  f"cache (evicted since, or never held)")
            blocks.append(block)
        self.pool.touch(blocks)
        return blocks

    def release_held(self, blocks: Sequence[Block]) -> None:
        """Give back what `hold_cached` took."""
        self.pool.release(reversed(blocks))

    def take_tier_ops(self) -> TierOps:
        """The tiers' copies for the next step (none without tiers)."""
        return self.tiers.take_ops() if self.tiers is not None else TierOps()

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail first (evicted before shared heads)."""
        blocks = self._blocks.pop(request.request_id, [])
        if self.tiers is not None:  # a reservation ended before the next step ran its loads
            self.tiers.cancel_loads([b.block_id for b in blocks])
        self.pool.release(reversed(blocks))
        self._num_cached_blocks.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drop the request entirely (finished or aborted): blocks and its hash chain."""
        self.free(request)
        self._hashes.pop(request.request_id, None)

    def _chain(self, request: Request, tokens: list[int]) -> list[BlockHash]:
        """The request's block hashes covering `tokens`, extended and memoized (rooted at its
        adapter's, if it runs with one)."""
        chain = self._hashes.setdefault(request.request_id, [])
        if len(chain) < len(tokens) // self.block_size:
            chain[:] = hash_blocks(tokens, self.block_size, chain, chain_root(request.lora))
        return chain
