"""`TransferDescriptor`: where one request's KV goes, made by the decode side at reservation.

The decode worker reserves blocks first (admission = memory reservation), then hands this
descriptor to the router, which passes it to the prefill worker. It names every rank on both
sides, each destination rank's block ids and KV-head range, the layout id both ends must share
and an absolute deadline (`time.time()` seconds: hosts must keep their clocks NTP-synced).

`first_block` = k: the decode side's prefix cache holds the prompt's first k blocks (shared:
no descriptor names them, so no push reaches them); `block_ids` are blocks k, k+1, ... only.

Encoding: strict JSON, never pickle. The descriptor is a control-plane message of variable
length (one block id per 16 tokens) that crosses Ray and gRPC as bytes and lands in logs, so
a self-describing text form is worth its size (~1 KiB for a 2k-token prompt). Safety comes
from the decoder, not the format: the input size is capped before parsing, duplicate keys,
NaN/Infinity and unknown or missing keys are refused, every int is checked to be an int (not
a bool or a float) within bounds, and the result is re-validated by the dataclasses.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kvtransfer.layout import LAYOUT_ID_BYTES, KVLayout

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: first_block
TRANSFER_ID_BYTES = 16
MAX_ENCODED_BYTES = 1 << 20
MAX_RANKS = 64
MAX_BLOCKS = 1 << 16  # per request: 1M tokens at block size 16
MAX_BLOCK_ID = (1 << 31) - 1
MAX_REQUEST_ID_CHARS = 256
MAX_HOST_CHARS = 253


class DescriptorError(ValueError):
    """An encoded descriptor that is malformed, inconsistent or out of bounds."""


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise DescriptorError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


@dataclass(frozen=True)
class Endpoint:
    """One rank of a worker: the rendezvous store it listens on (host, port) and its TP rank."""

    host: str
    port: int
    rank: int

    def __post_init__(self) -> None:
        host = self.host
        if (not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS
                or not host.isascii() or not host.isprintable() or " " in host):
            raise DescriptorError(f"host must be a printable ASCII name of at most "
                                  f"{MAX_HOST_CHARS} characters, got {host!r}")
        _int(self.port, "port", 1, 65535)
        _int(self.rank, "rank", 0, MAX_RANKS - 1)

    @property
    def key(self) -> str:
        """The identity channels and reservations are keyed by."""
        return f"{self.host}:{self.port}/{self.rank}"


@dataclass(frozen=True)
class DestinationShard:
    """What one decode rank receives: its KV-head range into its reserved blocks."""

    endpoint: Endpoint
    block_ids: tuple[int, ...]  # destination block of the request's i-th block
    head_start: int
    head_end: int

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, Endpoint):
            raise DescriptorError(f"endpoint must be an Endpoint, got {self.endpoint!r}")
        if not isinstance(self.block_ids, tuple) or not 0 < len(self.block_ids) <= MAX_BLOCKS:
            raise DescriptorError(f"block_ids must be a tuple of 1..{MAX_BLOCKS} block ids")
        for b in self.block_ids:
            _int(b, "block id", 0, MAX_BLOCK_ID)
        if len(set(self.block_ids)) != len(self.block_ids):
            raise DescriptorError("block_ids must not repeat a block (two tokens, one slot)")
        _int(self.head_start, "head_start", 0, 1 << 16)
        _int(self.head_end, "head_end", self.head_start + 1, 1 << 16)


@dataclass(frozen=True)
class TransferDescriptor:
    """Everything both sides need to move one request's KV; never reused for another one."""

    transfer_id: bytes  # 16 random bytes, unique per request
    request_id: str
    layout_id: bytes
    sources: tuple[Endpoint, ...]  # prefill ranks, index = TP rank
    destinations: tuple[DestinationShard, ...]  # decode ranks, index = TP rank
    deadline: float  # absolute time.time() seconds
    first_block: int = 0  # the request's blocks before this one the decode side holds already

    def __post_init__(self) -> None:
        if not isinstance(self.transfer_id, bytes) or len(self.transfer_id) != TRANSFER_ID_BYTES:
            raise DescriptorError(f"transfer_id must be {TRANSFER_ID_BYTES} bytes")
        if not any(self.transfer_id):
            raise DescriptorError("transfer_id must not be all zeros (use new_transfer_id())")
        if not isinstance(self.request_id, str) or not 0 < len(self.request_id) <= (
                MAX_REQUEST_ID_CHARS):
            raise DescriptorError(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
        if not isinstance(self.layout_id, bytes) or len(self.layout_id) != LAYOUT_ID_BYTES:
            raise DescriptorError(f"layout_id must be {LAYOUT_ID_BYTES} bytes")
        self._check_ranks()
        _int(self.first_block, "first_block", 0, MAX_BLOCKS - self.num_pushed_blocks)
        if type(self.deadline) is not float or not math.isfinite(self.deadline) or (
                self.deadline <= 0):
            raise DescriptorError(f"deadline must be a finite time.time() float, "
                                  f"got {self.deadline!r}")

    def _check_ranks(self) -> None:
        for name, ranks in (("sources", self.sources), ("destinations", self.destinations)):
            if not isinstance(ranks, tuple) or not 0 < len(ranks) <= MAX_RANKS:
                raise DescriptorError(f"{name} must be a tuple of 1..{MAX_RANKS} ranks")
        for i, source in enumerate(self.sources):
            if not isinstance(source, Endpoint) or source.rank != i:
                raise DescriptorError(f"sources[{i}] must be an Endpoint with rank {i}")
        width = self.destinations[0].head_end - self.destinations[0].head_start
        for j, dest in enumerate(self.destinations):
            if not isinstance(dest, DestinationShard) or dest.endpoint.rank != j:
                raise DescriptorError(f"destinations[{j}] must be a DestinationShard of rank {j}")
            if len(dest.block_ids) != len(self.destinations[0].block_ids):
                raise DescriptorError("every destination rank must reserve the same number "
                                      "of blocks")
        ranges = [(d.head_start, d.head_end) for d in self.destinations]
        if ranges not in ([(j * width, (j + 1) * width) for j in range(len(ranges))],
                          [(0, width)] * len(ranges)):
            raise DescriptorError("destination head ranges must split the KV heads evenly "
                                  "in rank order, or each be all of them (a latent cache)")

    @classmethod
    def new(
        cls, request_id: str, layout: KVLayout, sources: Sequence[Endpoint],
        destinations: Sequence[tuple[Endpoint, Sequence[int]]], deadline: float,
        first_block: int = 0,
    ) -> TransferDescriptor:
        """A fresh descriptor (new random transfer id, head ranges from the layout) whose
        `destinations` name the request's blocks from `first_block` on."""
        ranges = layout.head_ranges(len(destinations))
        shards = tuple(DestinationShard(ep, tuple(int(b) for b in ids), h0, h1)
                       for (ep, ids), (h0, h1) in zip(destinations, ranges, strict=True))
        return cls(new_transfer_id(), request_id, layout.layout_id, tuple(sources), shards,
                   float(deadline), first_block)

    @property
    def num_blocks(self) -> int:
        """Every block of the request on the decode side: held already, then pushed."""
        return self.first_block + self.num_pushed_blocks

    @property
    def num_pushed_blocks(self) -> int:
        """Blocks the prefill side sends: the request's blocks [first_block, num_blocks)."""
        return len(self.destinations[0].block_ids)

    def pushed_nbytes(self, layout: KVLayout) -> int:
        """KV bytes the prefill side sends (every layer, every KV head: all ranks together)."""
        return self.num_pushed_blocks * _request_block_nbytes(layout)

    def skipped_nbytes(self, layout: KVLayout) -> int:
        """KV bytes not sent because the decode side held those blocks already."""
        return self.first_block * _request_block_nbytes(layout)

    def check_layout(self, layout: KVLayout) -> None:
        """Raise ValueError unless this descriptor was made for `layout`."""
        if self.layout_id != layout.layout_id:
            raise ValueError(f"descriptor of {self.request_id!r} has layout id "
                             f"{self.layout_id.hex()}, this worker's is {layout.layout_id.hex()} "
                             f"({layout}); the prefill and decode models/cache configs differ")
        ranges = [(d.head_start, d.head_end) for d in self.destinations]
        if ranges != layout.head_ranges(len(ranges)):
            raise ValueError(f"descriptor head ranges {ranges} are not the layout's "
                             f"{layout.head_ranges(len(ranges))} ({layout.num_kv_heads} KV heads, "
                             f"{layout.kind}, over {len(ranges)} ranks)")

    def encode(self) -> bytes:
        """UTF-8 JSON; `decode(encode(d)) == d`."""
        doc = {
            "v": FORMAT_VERSION,
            "transfer_id": self.transfer_id.hex(),
            "request_id": self.request_id,
            "layout_id": self.layout_id.hex(),
            "sources": [[s.host, s.port, s.rank] for s in self.sources],
            "destinations": [
                {"endpoint": [d.endpoint.host, d.endpoint.port, d.endpoint.rank],
                 "block_ids": list(d.block_ids), "heads": [d.head_start, d.head_end]}
                for d in self.destinations
            ],
            "deadline": self.deadline,
            "first_block": self.first_block,
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> TransferDescriptor:
        """Parse and validate an encoded descriptor; raises DescriptorError (a ValueError)."""
        doc = _load_json(data)
        if isinstance(doc, dict) and (type(doc.get("v")) is not int
                                      or doc["v"] != FORMAT_VERSION):
            raise DescriptorError(f"descriptor version must be {FORMAT_VERSION}, got "
                                  f"{doc.get('v')!r:.20}: both ends must run the same release")
        _keys(doc, {"v", "transfer_id", "request_id", "layout_id", "sources", "destinations",
                    "deadline", "first_block"}, "descriptor")
        deadline = doc["deadline"]
        if type(deadline) not in (int, float) or not -1e300 < deadline < 1e300:
            raise DescriptorError(f"deadline must be a time.time() number, got {deadline!r:.40}")
        return cls(
            _hex(doc["transfer_id"], TRANSFER_ID_BYTES, "transfer_id"),
            doc["request_id"] if isinstance(doc["request_id"], str) else _bad("request_id"),
            _hex(doc["layout_id"], LAYOUT_ID_BYTES, "layout_id"),
            tuple(_endpoint(s) for s in _list(doc["sources"], MAX_RANKS, "sources")),
            tuple(_shard(d) for d in _list(doc["destinations"], MAX_RANKS, "destinations")),
            float(deadline),
            doc["first_block"],  # its type and bounds are checked by __post_init__
        )


def _request_block_nbytes(layout: KVLayout) -> int:
    """K and V bytes of one request block over every layer and every KV head."""
    return layout.num_layers * layout.block_nbytes(layout.num_kv_heads)


def new_transfer_id() -> bytes:
    """16 bytes from the OS CSPRNG: unguessable, so an id doubles as the transfer's capability."""
    return os.urandom(TRANSFER_ID_BYTES)


def _bad(name: str) -> Any:
    raise DescriptorError(f"{name} has the wrong type")


def _load_json(data: bytes | str) -> Any:
    if isinstance(data, str):
        data = data.encode("utf-8", errors="strict")
    if not isinstance(data, (bytes, bytearray)):
        raise DescriptorError(f"an encoded descriptor is bytes or str, got {type(data).__name__}")
    if len(data) > MAX_ENCODED_BYTES:
        raise DescriptorError(f"encoded descriptor is {len(data)} bytes, max {MAX_ENCODED_BYTES}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        doc = dict(pairs)
        if len(doc) != len(pairs):
            raise DescriptorError("duplicate key in descriptor")
        return doc

    def no_constants(name: str) -> Any:
        raise DescriptorError(f"{name} is not allowed in a descriptor")

    try:
        return json.loads(bytes(data).decode("utf-8"), object_pairs_hook=no_duplicates,
                          parse_constant=no_constants)
    except DescriptorError:
        raise
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, ints past the digit limit
        raise DescriptorError(f"descriptor is not valid JSON: {type(e).__name__}: {e}") from None


def _keys(doc: Any, expected: set[str], what: str) -> None:
    if not isinstance(doc, dict) or set(doc) != expected:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise DescriptorError(f"{what} must have exactly the keys {sorted(expected)}, got {got}")


def _list(value: Any, max_len: int, name: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > max_len:
        raise DescriptorError(f"{name} must be a list of at most {max_len} items")
    return value


def _hex(value: Any, nbytes: int, name: str) -> bytes:
    if (not isinstance(value, str) or len(value) != 2 * nbytes
            or any(c not in "0123456789abcdef" for c in value)):
        raise DescriptorError(f"{name} must be {2 * nbytes} lowercase hex digits")
    return bytes.fromhex(value)


def _endpoint(value: Any) -> Endpoint:
    if not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str):
        raise DescriptorError(f"an endpoint is [host, port, rank], got {value!r:.80}")
    return Endpoint(value[0], value[1], value[2])


def _shard(value: Any) -> DestinationShard:
    _keys(value, {"endpoint", "block_ids", "heads"}, "a destination")
    heads = _list(value["heads"], 2, "heads")
    if len(heads) != 2:
        raise DescriptorError("heads must be [head_start, head_end]")
    block_ids = tuple(_list(value["block_ids"], MAX_BLOCKS, "block_ids"))
    return DestinationShard(_endpoint(value["endpoint"]), block_ids, heads[0], heads[1])
