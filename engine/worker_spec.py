"""WorkerSpec: what one worker process needs to build its engine, as plain JSON-able values.

The launcher derives one per worker from the service settings and hands it to the Ray actor,
which builds its EngineConfig here (so the router, which never imports torch, never does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_config
from pdserve.redis_keys import DEFAULT_NAMESPACE


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    model: str  # HF-format directory
    model_name: str  # the served name: part of the KV layout id both sides check
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    device: str = "cpu"
    kernel_backend: str | None = None
    seed: int = 0
    num_threads: int | None = None
    host: str = "127.0.0.1"  # where its gRPC service and KV endpoints bind; "auto": node IP
    redis_url: str | None = None  # prefill workers publish their prefix-cache events there
    redis_password: str | None = None
    redis_namespace: str = DEFAULT_NAMESPACE

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=load_model_config(self.model, self.dtype, self.max_model_len),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens),
            device=self.device,
            num_threads=self.num_threads,
            seed=self.seed,
            kernel_backend=self.kernel_backend,
        )

    def with_resolved_host(self) -> WorkerSpec:
        """`host="auto"` becomes this node's address as Ray knows it: what other nodes (the
        router, the peer pool's KV transfers) reach it by on a multi-node cluster."""
        if self.host != "auto":
            return self
        import ray

        return dataclasses.replace(self, host=ray.util.get_node_ip_address())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerSpec:
        return cls(**data)
