"""The disk tier's file format: one file per KV cache block, checked on every read.

A block's file is `root/<layout_id.hex()>/<block_hash.hex()>.kv`, little-endian:

    magic b"PDKVBLK", version (uint8, 1)
    layout_id (16 bytes)        model, dtype, block size, head shard, rank... of the writer
    block_hash (16 bytes)       the chained hash of engine/block_hash.py
    num_tokens (uint32), payload_nbytes (uint64)
    payload checksum            blake2b, digest_size=16, person=b"pdkv-payload"
    token ids                   num_tokens int32
    header checksum             blake2b, digest_size=16, person=b"pdkv-header", over all above
    payload                     payload_nbytes bytes

A torn, truncated, corrupt or foreign file is a miss, never data: `read` checks the size,
both checksums, the layout id, the hash and the token ids, and deletes a file that fails.
Writes go to a temp file and `os.replace` onto the name, so a crash leaves the old file or
none (plus a `*.tmp` that `scan` removes). No fsync: a file torn by a power cut is caught by
the same checks and costs only a recompute. A store holds one block size and payload size,
so every file has the same size, `file_nbytes`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

_MAGIC, _VERSION = b"PDKVBLK", 1
_DIGEST_NBYTES = _ID_NBYTES = 16
# magic, version, layout_id, block_hash, num_tokens, payload_nbytes, payload checksum
_FIXED = struct.Struct("<7sB16s16sIQ16s")
_SUFFIX, _TMP_SUFFIX = ".kv", ".tmp"


def _digest(data: bytes | memoryview, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_NBYTES, person=person).digest()


def _header_nbytes(num_tokens: int) -> int:
    return _FIXED.size + 4 * num_tokens + _DIGEST_NBYTES


class DiskKVStore:
    """One worker's (one TP rank's) block files under `root/<layout_id.hex()>/`."""

    def __init__(self, root: str | os.PathLike, layout_id: bytes, block_size: int,
                 payload_nbytes: int) -> None:
        if len(layout_id) != _ID_NBYTES:
            raise ValueError(f"layout_id must be a 16-byte digest, got {len(layout_id)} bytes")
        if block_size < 1:
            raise ValueError(f"block_size (tokens per block) must be >= 1: {block_size}")
        if payload_nbytes < 1:
            raise ValueError(f"payload_nbytes (one block's bytes) must be >= 1: {payload_nbytes}")
        self.layout_id = bytes(layout_id)
        self.payload_nbytes = payload_nbytes
        self.dir = Path(root) / self.layout_id.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.num_corrupt = 0
        self._num_tokens = block_size

    @property
    def file_nbytes(self) -> int:
        """Bytes one block's file takes (header + payload)."""
        return _header_nbytes(self._num_tokens) + self.payload_nbytes

    def write(self, block_hash: bytes, token_ids: Sequence[int],
              payload: bytes | bytearray | memoryview) -> None:
        view = memoryview(payload).cast("B")
        if view.nbytes != self.payload_nbytes:
            raise ValueError(f"payload is {view.nbytes} bytes, blocks are {self.payload_nbytes}")
        if len(block_hash) != _ID_NBYTES:
            raise ValueError(f"block_hash must be {_ID_NBYTES} bytes, got {len(block_hash)}")
        if len(token_ids) != self._num_tokens:
            raise ValueError(f"a block has {self._num_tokens} tokens, got {len(token_ids)}")
        head = _FIXED.pack(_MAGIC, _VERSION, self.layout_id, bytes(block_hash), len(token_ids),
                           self.payload_nbytes, _digest(view, b"pdkv-payload"))
        try:
            head += struct.pack(f"<{len(token_ids)}i", *token_ids)
        except struct.error as e:
            raise ValueError(f"token ids must be int32: {e}") from e
        head += _digest(head, b"pdkv-header")
        path = self._path(block_hash)
        # Random suffix: two writers of one block (threads, a retry) must not share a temp file.
        tmp = path.with_name(f"{path.name}.{os.urandom(4).hex()}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(view)
                f.flush()
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def read(self, block_hash: bytes, token_ids: Sequence[int]) -> bytes | None:
        """The payload, or None if the file is missing or bad (a bad file is deleted)."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                header = self._read_header(f)
                if isinstance(header, str):
                    return self._reject(path, header)
                stored_hash, stored_tokens, payload_digest = header
                payload = f.read(self.payload_nbytes)
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._reject(path, f"unreadable ({e})")
        if stored_hash != block_hash:
            return self._reject(path, f"holds block {stored_hash.hex()}")
        if stored_tokens != tuple(token_ids):
            return self._reject(path, "holds other token ids")
        if _digest(payload, b"pdkv-payload") != payload_digest:  # also a file cut since fstat
            return self._reject(path, "payload checksum mismatch")
        return payload

    def delete(self, block_hash: bytes) -> None:
        self._path(block_hash).unlink(missing_ok=True)

    def scan(self) -> list[tuple[bytes, tuple[int, ...]]]:
        """(block_hash, token_ids) of every file with a valid header, oldest first by mtime;
        deletes temp files and bad headers. Payloads are not read (read() checks them). Call it
        at startup, before writes: it deletes the temp file of a write in flight."""
        found: list[tuple[float, bytes, tuple[int, ...]]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(_TMP_SUFFIX):  # a write that died before os.replace
                self._reject(path, "leftover temp file")
            if not path.name.endswith(_SUFFIX):
                continue  # a temp file (gone now) or not ours to judge
            try:
                with open(path, "rb") as f:
                    header = self._read_header(f)
                    mtime = os.fstat(f.fileno()).st_mtime
            except OSError as e:
                header = f"unreadable ({e})"
            if isinstance(header, str):
                self._reject(path, header)
            elif path.name != header[0].hex() + _SUFFIX:
                self._reject(path, f"holds block {header[0].hex()}")
            else:
                found.append((mtime, header[0], header[1]))
        found.sort(key=lambda entry: entry[0])
        return [(block_hash, tokens) for _, block_hash, tokens in found]

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (bytes(block_hash).hex() + _SUFFIX)

    def _read_header(self, f: BinaryIO) -> tuple[bytes, tuple[int, ...], bytes] | str:
        """(block_hash, token_ids, payload checksum) from a valid header, else why not.
        Leaves `f` at the payload."""
        fixed = f.read(_FIXED.size)
        if len(fixed) != _FIXED.size:
            return f"truncated ({len(fixed)} bytes)"
        magic, version, layout_id, block_hash, num_tokens, payload_nbytes, payload_digest = (
            _FIXED.unpack(fixed))
        if magic != _MAGIC or version != _VERSION:
            return f"bad magic or version ({magic!r}, {version})"
        # Checked against the actual size before trusting num_tokens to size a read.
        expected = _header_nbytes(num_tokens) + payload_nbytes
        size = os.fstat(f.fileno()).st_size
        if size != expected:
            return f"size {size} bytes, header says {expected}"
        rest = f.read(_header_nbytes(num_tokens) - _FIXED.size)
        tokens, checksum = rest[:-_DIGEST_NBYTES], rest[-_DIGEST_NBYTES:]
        if _digest(fixed + tokens, b"pdkv-header") != checksum:
            return "header checksum mismatch"
        if layout_id != self.layout_id:
            return f"written under layout {layout_id.hex()}"
        if num_tokens != self._num_tokens or payload_nbytes != self.payload_nbytes:
            return f"{num_tokens} tokens, {payload_nbytes} payload bytes"
        return block_hash, struct.unpack(f"<{num_tokens}i", tokens), payload_digest

    def _reject(self, path: Path, why: str) -> None:
        """Count, log and delete a bad file; the file is gone, so this logs once per file."""
        self.num_corrupt += 1
        logger.warning("disk KV file %s is bad, deleting it: %s", path, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            logger.warning("could not delete %s: %s", path, e)
