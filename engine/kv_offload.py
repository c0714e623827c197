"""KVOffload: the runner's side of the KV tiers; it copies what engine.kv_tiers decided.

The host tier is one byte tensor, `[num_slots, block_nbytes]` (pinned on CUDA), a slot holding
one device block: every layer's K and V (and an int8 cache's scales), in that order. The disk
tier is engine.kv_disk's files, one per block, under a directory named by this rank's layout id.

Per step, `start(ops)` hands the plan's loads (host -> device) to the loader thread, which
copies them layer by layer while the forward runs (engine.kv_layer_loads: the forward waits
for layer i's loads just before layer i), and its demotions, stores, promotions and deletes, in
that order, to one copy thread, which first waits for the step's loads (they read slots these
ops may write), so they overlap the forward and run in the order the tiers decided them. It
also times them:
`host_load_s` and `disk_load_s` are the seconds one block takes to load from host and to read
back from disk (moving averages; None before the first), what the router prices a tier hit
by (on CUDA the loads' time is their launch's). `results()` reports
the copies finished since the last call; with `wait` it waits for all of them (a step with
nothing else to do). On CUDA the loader and the copy thread each use a stream of their own;
the loader's first waits for the compute stream (a fresh block may still be written by the
last step's kernels).

On a tensor-parallel group every rank runs the same ops on its own KV-head shard, each on its
own thread, so a copy may have landed on one rank and not yet on another. With `agree` (the
group's host all-reduce, a sum) `results()` reports an op only once every rank has finished it,
and as failed if it failed on any: the ranks sum, per op still outstanding, whether it finished
and whether it failed. Every rank issues the same batches in the same order and drops the
same agreed ones, so the outstanding ops, and the collective's length, match; the caller calls
`results()` on every rank at the same step whenever `busy`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch

from pdserve.engine.block_hash import BlockHash
from pdserve.engine.kv_disk import DiskKVStore
from pdserve.engine.kv_layer_loads import LayerLoads
from pdserve.engine.kv_tiers import TierOps, TierResults

logger = logging.getLogger(__name__)


def layout_id(description: dict[str, Any]) -> bytes:
    """16 bytes naming what a block's bytes mean (model, dtype, shapes, TP rank)."""
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16, person=b"pdkv-layout").digest()


_KINDS = tuple(f.name for f in fields(TierResults))
FAILED_KIND = {"stored": "failed_stores", "demoted": "failed_demotions",
               "promoted": "failed_promotions"}


@dataclass
class _Done:
    """One op's outcome, reported once."""

    kind: str  # a TierResults field name
    key: Any  # host slot (stored) or block hash


class KVOffload:
    def __init__(
        self, kv_caches: Sequence[tuple[torch.Tensor, ...]], host_bytes: int,
        disk_path: str | None = None, disk_bytes: int = 0, layout: dict[str, Any] | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`kv_caches`: per layer the cache tensors, blocks first (`[num_blocks, ...]`);
        `layout`: what this rank's block bytes mean (the disk files' layout id); `agree`: a
        tensor-parallel group's host all-reduce (sum), None for a single rank."""
        self._parts = [t for layer in kv_caches for t in layer]
        self.num_layers = len(kv_caches)
        self._cuda = self._parts[0].device.type == "cuda"
        self._sizes = [t[0].numel() * t.element_size() for t in self._parts]
        self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self.block_nbytes = sum(self._sizes)
        for t, off in zip(self._parts, self._offsets):  # every view of a slot stays aligned
            assert off % t.element_size() == 0 and self.block_nbytes % 8 == 0, (off, t.dtype)
        self.num_host_slots = host_bytes // self.block_nbytes
        if self.num_host_slots < 1:
            raise ValueError(f"kv_host_bytes: {host_bytes} bytes hold no block of "
                             f"{self.block_nbytes} bytes; raise it or set it to 0")
        self.host = torch.empty((self.num_host_slots, self.block_nbytes), dtype=torch.uint8,
                                pin_memory=self._cuda)
        self.disk = None
        self.num_disk_blocks = 0
        if disk_path is not None:
            block_size = self._parts[0].shape[1]  # [num_blocks, block_size, ...]
            self.disk = DiskKVStore(disk_path, layout_id(layout or {}), block_size,
                                    self.block_nbytes)
            self.num_disk_blocks = disk_bytes // self.disk.file_nbytes
            if self.num_disk_blocks < 1:
                raise ValueError(f"kv_disk_bytes: {disk_bytes} bytes hold no block file of "
                                 f"{self.disk.file_nbytes} bytes; raise it")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        device = self._parts[0].device
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._load_stream = torch.cuda.Stream(device) if self._cuda else None
        # batches on the copy thread, in issue order, with their number of ops
        self._running: list[tuple[Future, int]] = []
        self._finished: list[list[_Done]] = []  # ... done here, not yet agreed by every rank
        self._agree = agree
        self.host_load_s: float | None = None
        self.disk_load_s: float | None = None
        logger.info("KV tiers: host %d blocks (%.1f MiB)%s", self.num_host_slots,
                    self.host.numel() / 2**20, f", disk {self.num_disk_blocks} blocks under "
                    f"{disk_path}" if self.disk else "")

    def start(self, ops: TierOps) -> LayerLoads | None:
        """Start the step's copies: its loads on the loader (the step waits for each layer's
        through the LayerLoads returned, None without loads), the rest on the copy thread."""
        loads = None
        if ops.loads:
            loads = LayerLoads(self.num_layers)
            after = None
            if self._cuda:
                after = torch.cuda.Event()
                after.record()
            self._loader.submit(self._load, ops.loads, loads, after)
        if ops.demotions or ops.stores or ops.promotions or ops.deletes:
            num_ops = len(ops.demotions) + len(ops.stores) + len(ops.promotions)
            self._running.append((self._thread.submit(self._run, ops, loads), num_ops))
        return loads

    @property
    def busy(self) -> bool:
        """Copies issued and not yet reported (a TP group's ranks agree on this)."""
        return bool(self._running or self._finished)

    def results(self, wait: bool = False) -> TierResults:
        """Copies that finished since the last call (all of them, with `wait`); on a TP
        group, those finished on every rank."""
        while self._running and (wait or self._running[0][0].done()):
            self._finished.append(self._running.pop(0)[0].result())
        if self._agree is None:
            done, self._finished = [d for batch in self._finished for d in batch], []
        else:
            done = self._agreed()
        return TierResults(**{kind: tuple(d.key for d in done if d.kind == kind)
                              for kind in _KINDS})

    def _agreed(self) -> list[_Done]:
        """The outstanding ops every rank has finished (a leading run of batches: each rank's
        thread finishes them in order), failed where any rank failed one."""
        if not self.busy:
            return []
        sizes = [len(b) for b in self._finished] + [n for _, n in self._running]
        ops = [d for batch in self._finished for d in batch]
        n, k = sum(sizes), len(ops)
        # summed over the ranks: [the group's size, per op whether it finished, per op whether
        # it failed]; this rank finished the first k
        mine = torch.zeros(1 + 2 * n, dtype=torch.int64)
        mine[0], mine[1:1 + k] = 1, 1
        mine[1 + n:1 + n + k] = torch.tensor([d.kind.startswith("failed") for d in ops])
        counts = self._agree(mine).tolist()
        finished, failed_by = counts[1:1 + n], counts[1 + n:]
        agreed, start = [], 0
        for size in sizes[:len(self._finished)]:
            if any(c < counts[0] for c in finished[start:start + size]):
                break  # not finished on every rank yet
            agreed += [_Done(FAILED_KIND.get(d.kind, d.kind) if f else d.kind, d.key)
                       for d, f in zip(self._finished.pop(0), failed_by[start:start + size])]
            start += size
        return agreed

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._thread.shutdown(wait=True)

    # ---- the loader ----

    def _load(self, pairs: Sequence[tuple[int, int]], loads: LayerLoads,
              after: torch.cuda.Event | None) -> None:
        """Each (host slot, device block) of `pairs`, one layer after another."""
        start = time.perf_counter()
        try:
            with torch.cuda.stream(self._load_stream) if self._cuda else nullcontext():
                if after is not None:
                    self._load_stream.wait_event(after)
                per_layer = len(self._parts) // self.num_layers
                for layer in range(self.num_layers):
                    parts = range(layer * per_layer, (layer + 1) * per_layer)
                    for slot, block_id in pairs:
                        self._copy(slot, block_id, to_device=True, parts=parts)
                    event = None
                    if self._cuda:
                        event = torch.cuda.Event()
                        event.record(self._load_stream)
                    loads.land(layer, event)
        except Exception as exc:  # the step fails; its blocks are attended to by no one
            logger.exception("KV tiers: loading %d blocks from host failed", len(pairs))
            loads.fail(exc)
            return
        self.host_load_s = _average(self.host_load_s, (time.perf_counter() - start) / len(pairs))

    # ---- the copy thread ----

    def _run(self, ops: TierOps, loads: LayerLoads | None) -> list[_Done]:
        """The ops' outcomes; if anything unexpected fails, every op of the batch fails (its
        blocks are then misses, and the device blocks held for its stores are let go)."""
        try:
            return self._run_ops(ops, loads)
        except Exception:
            logger.exception("KV tiers: a batch of copies failed")
            return ([_Done("failed_demotions", h) for _, h, _ in ops.demotions]
                    + [_Done("failed_stores", slot) for _, slot in ops.stores]
                    + [_Done("failed_promotions", h) for h, _, _ in ops.promotions])

    def _run_ops(self, ops: TierOps, loads: LayerLoads | None) -> list[_Done]:
        if loads is not None:
            loads.join()  # the step's loads read slots these ops may write
        done = [self._demote(slot, h, tokens) for slot, h, tokens in ops.demotions]
        with torch.cuda.stream(self._stream) if self._cuda else nullcontext():
            for block_id, slot in ops.stores:
                self._copy(slot, block_id, to_device=False)
        if self._stream is not None:
            self._stream.synchronize()
        done += [_Done("stored", slot) for _, slot in ops.stores]
        done += [self._promote(h, tokens, slot) for h, tokens, slot in ops.promotions]
        for block_hash in ops.deletes:
            self.disk.delete(block_hash)
        return done

    def _demote(self, slot: int, block_hash: BlockHash, tokens: Sequence[int]) -> _Done:
        try:
            self.disk.write(block_hash, tokens, self.host[slot].numpy().tobytes())
        except OSError as exc:
            logger.warning("disk tier: writing block %s failed: %s", block_hash.hex(), exc)
            return _Done("failed_demotions", block_hash)
        return _Done("demoted", block_hash)

    def _promote(self, block_hash: BlockHash, tokens: Sequence[int], slot: int) -> _Done:
        start = time.perf_counter()
        payload = self.disk.read(block_hash, tokens)
        if payload is None:
            return _Done("failed_promotions", block_hash)
        self.host[slot].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.disk_load_s = _average(self.disk_load_s, time.perf_counter() - start)
        return _Done("promoted", block_hash)

    def _copy(self, slot: int, block_id: int, to_device: bool,
              parts: Sequence[int] | None = None) -> None:
        """One block between its device cache rows and its host slot, part by part (`parts`:
        indexes into every layer's tensors; all of them by default), on the caller's stream."""
        row = self.host[slot]
        for i in parts if parts is not None else range(len(self._parts)):
            t, off, n = self._parts[i], self._offsets[i], self._sizes[i]
            host = row[off:off + n].view(t.dtype).view(t.shape[1:])
            if to_device:
                t[block_id].copy_(host, non_blocking=self._cuda)
            else:
                host.copy_(t[block_id], non_blocking=self._cuda)


def _average(mean: float | None, sample: float, weight: float = 0.2) -> float:
    """An exponential moving average (the first sample starts it)."""
    return sample if mean is None else (1 - weight) * mean + weight * sample
