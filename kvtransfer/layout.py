"""The KV layout both ends of a transfer must share, its id, and the TP head-split math.

Per layer a paged cache is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
A tensor-parallel rank holds a contiguous range of KV heads, so moving KV from a prefill group
with TP=p to a decode group with TP=d is a set of head-range intersections: source rank i owns
`[i*H/p, (i+1)*H/p)`, destination rank j owns `[j*H/d, (j+1)*H/d)`, and i sends j exactly the
overlap (`reshard_routes`). Head ranges are always *global* head indices; each side converts
to its local cache index by subtracting its own shard start.

A latent cache (`kind="latent"`, multi-head latent attention) holds one entry per token and
layer, not split over ranks: every tensor-parallel rank holds all of it, so every destination
rank receives the whole entry, from source rank `j % p`. On the wire an entry travels as its
two halves, in the places K and V take for a per-head cache (`transfer_view`), each half one
"head" of `head_dim` values: the bytes moved per token are exactly the entry's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Wire codes of the cache dtypes (header.py): never renumber, only append.
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
LAYOUT_ID_BYTES = 16
MAX_MODEL_ID_CHARS = 256
_LIMITS = {"block_size": 4096, "num_layers": 4096, "num_kv_heads": 4096, "head_dim": 4096}
KINDS = ("heads", "latent")


@dataclass(frozen=True)
class KVLayout:
    """What a KV block means. Two workers may exchange KV only if their layouts are equal."""

    model: str  # a stable model name (not a local path: P and D may keep weights elsewhere)
    dtype: str  # "float32" | "float16" | "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int  # total over all TP ranks (a latent cache: 1)
    head_dim: int  # a latent cache: half its entry
    kind: str = "heads"  # "heads": K and V per KV head; "latent": one entry, on every rank

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not 0 < len(self.model) <= MAX_MODEL_ID_CHARS:
            raise ValueError(f"model must be a non-empty name of at most {MAX_MODEL_ID_CHARS} "
                             f"characters, got {self.model!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_CODES)}, got {self.dtype!r}")
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if type(value) is not int or not 0 < value <= limit:
                raise ValueError(f"{name} must be an int in [1, {limit}], got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise ValueError(f"a latent cache is one head, got num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_model_config(cls, config: Any, block_size: int, model: str | None = None) -> KVLayout:
        """From an `engine.config.ModelConfig`; `model` defaults to the checkpoint dir name."""
        name = model or str(config.path).rstrip("/").rsplit("/", 1)[-1]
        if config.latent_dim:
            if config.latent_dim % 2:
                raise ValueError(f"a latent KV entry of {config.latent_dim} values can't travel "
                                 "as two halves (kv_lora_rank + qk_rope_head_dim must be even)")
            return cls(name, config.dtype, block_size, config.num_layers, 1,
                       config.latent_dim // 2, "latent")
        return cls(name, config.dtype, block_size, config.num_layers, config.num_kv_heads,
                   config.head_dim)

    @cached_property
    def layout_id(self) -> bytes:
        """16 bytes that change when anything a block's bytes depend on changes."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=LAYOUT_ID_BYTES,
                               person=b"pdserve-kv-v1").digest()

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    @property
    def element_size(self) -> int:
        return _ELEMENT_SIZE[self.dtype]

    def block_nbytes(self, num_heads: int) -> int:
        """Bytes of K and V of one block of one layer, for `num_heads` KV heads."""
        return 2 * self.block_size * num_heads * self.head_dim * self.element_size

    def head_ranges(self, tp_size: int) -> list[tuple[int, int]]:
        """The global KV-head range `[start, end)` each of `tp_size` ranks holds (a latent
        cache: all of it, on every rank)."""
        if type(tp_size) is not int or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        if self.kind == "latent":
            return [(0, self.num_kv_heads)] * tp_size
        if self.num_kv_heads % tp_size:
            divisors = [t for t in range(1, self.num_kv_heads + 1) if self.num_kv_heads % t == 0]
            raise ValueError(
                f"{self.num_kv_heads} KV heads of {self.model!r} can't be split evenly over "
                f"TP={tp_size}; use a TP size in {divisors}")
        width = self.num_kv_heads // tp_size
        return [(r * width, (r + 1) * width) for r in range(tp_size)]

    def describe_difference(self, other: KVLayout) -> str:
        """`field: ours vs theirs` for every field that differs (for mismatch errors)."""
        diffs = [f"{f.name}: {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        return ", ".join(diffs) or "identical"


@dataclass(frozen=True)
class ShardRoute:
    """Source rank `source_rank` sends KV heads `[head_start, head_end)` to `dest_rank`."""

    source_rank: int
    dest_rank: int
    head_start: int
    head_end: int


def reshard_routes(layout: KVLayout, source_tp: int, dest_tp: int) -> list[ShardRoute]:
    """Every (source rank, destination rank, head range) of a TP=p -> TP=d transfer.

    Each global head appears in exactly one route per destination rank; raises ValueError when
    either TP size does not divide the number of KV heads. A latent cache: destination rank j
    gets the whole entry from source rank j % source_tp.
    """
    if layout.kind == "latent":
        return [ShardRoute(j % source_tp, j, 0, layout.num_kv_heads) for j in range(dest_tp)]
    sources, dests = layout.head_ranges(source_tp), layout.head_ranges(dest_tp)
    routes = []
    for i, (s0, s1) in enumerate(sources):
        for j, (d0, d1) in enumerate(dests):
            start, end = max(s0, d0), min(s1, d1)
            if start < end:
                routes.append(ShardRoute(i, j, start, end))
    return routes


def routes_from(
    layout: KVLayout, source_rank: int, source_tp: int, dest_tp: int
) -> list[ShardRoute]:
    """The routes one source rank sends (in destination-rank order)."""
    if not 0 <= source_rank < source_tp:
        raise ValueError(f"source_rank must be in [0, {source_tp}), got {source_rank}")
    return [r for r in reshard_routes(layout, source_tp, dest_tp) if r.source_rank == source_rank]


def routes_to(layout: KVLayout, dest_rank: int, source_tp: int, dest_tp: int) -> list[ShardRoute]:
    """The routes one destination rank receives (in source-rank order)."""
    if not 0 <= dest_rank < dest_tp:
        raise ValueError(f"dest_rank must be in [0, {dest_tp}), got {dest_rank}")
    return [r for r in reshard_routes(layout, source_tp, dest_tp) if r.dest_rank == dest_rank]


def transfer_view(layout: KVLayout, kv_caches: Sequence[tuple[torch.Tensor, ...]]
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, what a transfer moves as the wire's (K, V): a per-head cache's K and V; a
    latent cache's two halves of every entry, each viewed `[num_blocks, block_size, 1,
    head_dim]` (the module doc)."""
    if layout.kind == "heads":
        return [(kv[0], kv[1]) for kv in kv_caches]
    half = layout.head_dim
    return [(c[..., :half].unsqueeze(2), c[..., half:].unsqueeze(2)) for (c,) in kv_caches]


def check_kv_caches(
    layout: KVLayout, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], num_heads: int
) -> torch.device:
    """Validate [(k, v)] per layer against the layout's shard; returns their device."""
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"kv_caches has {len(kv_caches)} layers, the layout {layout.num_layers}")
    k0 = kv_caches[0][0]
    shape = (k0.shape[0], layout.block_size, num_heads, layout.head_dim)
    for i, (k, v) in enumerate(kv_caches):
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != shape or t.dtype != layout.torch_dtype or t.device != k0.device:
                raise ValueError(
                    f"layer {i} {name} cache is {tuple(t.shape)} {t.dtype} on {t.device}; "
                    f"expected [num_blocks, block_size, heads of this rank, head_dim] = {shape} "
                    f"{layout.torch_dtype} on {k0.device}")
    return k0.device
