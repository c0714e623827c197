"""Chained block hashes: h_i = H(h_{i-1}, tokens_i), shared by workers and the router.

Stable across processes and languages (blake2b over little-endian int32 token ids), so the
router's prefix index and every worker's cache name the same blocks. No torch here.

A request run with a LoRA adapter starts its chain at the adapter's root (`chain_root`), not at
nothing: its KV was computed with the adapter, so the same tokens under another adapter (or
none) name other blocks, in every cache and in the prefix index alike.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Sequence

from pdserve.engine.lora_request import LoRARequest

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


def chain_root(lora: LoRARequest | None) -> BlockHash | None:
    """The parent of a chain's first block: None for the base model, else the adapter's (by
    name, id and path: an adapter loaded anew under an old name shares no block with it)."""
    if lora is None:
        return None
    key = json.dumps([lora.lora_name, lora.lora_int_id, lora.lora_path]).encode()
    return hashlib.blake2b(key, digest_size=_DIGEST_BYTES, person=b"pdserve-lora-v1").digest()


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parents: Sequence[BlockHash] = (),
    root: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, continuing the chain `parents` (a prefix);
    the first block's parent is `root` (`chain_root`)."""
    hashes = list(parents)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
    return hashes
