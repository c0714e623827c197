"""KV test data shared by the in-process tests and the subprocess peer (same seed, same bytes)."""

from __future__ import annotations

import time

import torch

from pdserve.cluster_secret import ClusterSecret
from pdserve.kvtransfer.descriptor import Endpoint, TransferDescriptor
from pdserve.kvtransfer.layout import KVLayout

Caches = list[tuple[torch.Tensor, torch.Tensor]]

# The cluster secret every test peer holds (subprocess peers get it through their environment).
SECRET = ClusterSecret.generate()

TINY = KVLayout("tiny-llama", "float32", block_size=4, num_layers=3, num_kv_heads=4, head_dim=8)


def full_caches(layout: KVLayout, num_blocks: int, seed: int, device: str = "cpu") -> Caches:
    """All KV heads, every value non-zero (so a block never written stays visibly zero)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def one() -> torch.Tensor:
        x = torch.rand(shape, generator=g, dtype=torch.float32) + 0.5
        return x.to(device, layout.torch_dtype)

    return [(one(), one()) for _ in range(layout.num_layers)]


def shard(caches: Caches, head_start: int, head_end: int) -> Caches:
    """One TP rank's cache: its KV-head slice, contiguous (as a worker allocates it)."""
    return [(k[:, :, head_start:head_end].contiguous(), v[:, :, head_start:head_end].contiguous())
            for k, v in caches]


def zero_caches(layout: KVLayout, num_blocks: int, num_heads: int, device: str = "cpu") -> Caches:
    shape = (num_blocks, layout.block_size, num_heads, layout.head_dim)
    return [(torch.zeros(shape, dtype=layout.torch_dtype, device=device),
             torch.zeros(shape, dtype=layout.torch_dtype, device=device))
            for _ in range(layout.num_layers)]


def endpoints(port: int, n: int, host: str = "127.0.0.1") -> list[Endpoint]:
    return [Endpoint(host, port, r) for r in range(n)]


def descriptor(
    layout: KVLayout, sources: list[Endpoint], dests: list[Endpoint], dst_blocks: list[int],
    ttl: float = 30.0, request_id: str = "req",
) -> TransferDescriptor:
    return TransferDescriptor.new(request_id, layout, sources, [(d, dst_blocks) for d in dests],
                                  time.time() + ttl)


def assert_landed(
    source: Caches, dest: Caches, src_blocks: list[int], dst_blocks: list[int],
    head_start: int, head_end: int,
) -> None:
    """dest[dst_blocks] == source[src_blocks] restricted to heads [head_start, head_end)."""
    for layer, ((sk, sv), (dk, dv)) in enumerate(zip(source, dest)):
        for name, s, d in (("k", sk, dk), ("v", sv, dv)):
            want = s[src_blocks][:, :, head_start:head_end]
            assert torch.equal(d[dst_blocks], want), f"layer {layer} {name} differs"
