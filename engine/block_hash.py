"""Chained block hashes: h_i = H(h_{i-1}, tokens_i), shared by workers and the router.

Stable across processes and languages (blake2b over little-endian int32 token ids), so the
router's prefix index and every worker's cache name the same blocks. No torch here.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes
_DIGEST_BYTES = 16


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    tokens = array("i", token_ids)  # 4-byte ints on every platform CPython supports
    if sys.byteorder == "big":
        tokens.byteswap()
    h = hashlib.blake2b(tokens.tobytes(), digest_size=_DIGEST_BYTES, person=b"pdserve-kv-v1")
    if parent is not None:
        h.update(parent)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parents: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, continuing the chain `parents` (a prefix)."""
    hashes = list(parents)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
    return hashes
