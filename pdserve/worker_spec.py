"""WorkerSpec: what one worker process needs to build its engine, as plain JSON-able values.

The launcher derives one per worker from the service settings and hands it to the Ray actor,
which builds its EngineConfig here (so the router, which never imports torch, never does).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    load_model_config,
)
from pdserve.engine.spec.config import parse_speculative_config
from pdserve.redis_keys import DEFAULT_NAMESPACE
from pdserve.tls import TLSFiles
from pdserve.worker_grpc import check_worker_tls, worker_tls


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
    quantization: str | None = None  # engine/quantization.py
    quantization_group_size: int = 0
    enable_prefix_caching: bool = True
    # KV tiers under the device pool (engine.kv_tiers), each worker its own: host memory and
    # local disk bytes; the disk tier lives in `<kv_disk_path>/<worker_id>` (engine_config)
    kv_host_bytes: int = 0
    kv_disk_path: str | None = None
    kv_disk_bytes: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # a step sized to last about this long (prefill workers); None: the token budget alone
    step_target_s: float | None = None
    scheduling_policy: str = "fcfs"  # the waiting queue's order: fcfs | srpt
    device: str = "cpu"
    kernel_backend: str | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode steps (engine.cuda_graphs)
    cuda_graph_sizes: list[int] | None = None  # the decode batch sizes captured; None: default
    seed: int = 0
    num_threads: int | None = None
    # MoE experts split whole over a decode group's ranks (engine.models.moe), not sliced
    enable_expert_parallel: bool = False
    # Speculative decoding (SpeculativeConfig's fields, plain JSON): decode workers only; the
    # launcher never gives it to a prefill worker. None: no speculation.
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (engine.config.LoRAConfig's fields, plain JSON); None: LoRA not enabled.
    # The adapters themselves come with each request (their paths on every node's disk).
    lora_config: dict[str, Any] | None = None
    host: str = "127.0.0.1"  # where its gRPC service and KV endpoints bind; "auto": node IP
    # prefill workers publish their prefix-cache events there; no credentials in it (the
    # password reaches the worker in its environment, defaults.REDIS_PASSWORD_ENV)
    redis_url: str | None = None
    redis_namespace: str = DEFAULT_NAMESPACE
    # A client-given reservation deadline is capped at now + this (a decode worker's blocks
    # are never held longer for a caller; 2x the router's default KV transfer timeout).
    max_reservation_s: float = 60.0
    # The decode Outputs stream sends keepalives only while the engine loop has run an
    # iteration within this long; silence after it tells the router the worker is wedged.
    stall_timeout_s: float = 30.0
    # Every collective of a decode TP group fails after this long (a hung rank fails the
    # step). Longer than max_reservation_s: a follower may wait that long for its KV shard
    # inside an admission all-reduce.
    tp_timeout_s: float = 90.0
    # Worker-plane mutual TLS (pdserve.worker_grpc): PEM paths, the same on every node (the
    # files are mounted there, never sent); all three or none. None: plaintext, secret only.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        check_worker_tls(self._tls_paths())
        parse_speculative_config(self.speculative_config)  # a bad field fails here, named
        self._lora()
        if self.kv_disk_path is not None and (Path(self.worker_id).name != self.worker_id
                                              or self.worker_id in ("", "..")):
            raise ValueError(f"worker_id {self.worker_id!r} names the worker's directory under "
                             "kv_disk_path: it must be a plain file name")
        for name in ("max_reservation_s", "stall_timeout_s", "tp_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.tp_timeout_s <= self.max_reservation_s:
            raise ValueError(
                f"tp_timeout_s ({self.tp_timeout_s}) must exceed max_reservation_s "
                f"({self.max_reservation_s}): a TP follower waits up to a reservation's "
                "lifetime for its KV inside a collective; raise tp_timeout_s")

    def _tls_paths(self) -> dict[str, str | None]:
        return {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}

    def tls(self) -> TLSFiles | None:
        """The gRPC server's mutual-TLS files, read on this worker's node; None: plaintext."""
        return worker_tls(self._tls_paths())

    @property
    def tp_beat_s(self) -> float:
        """How often an idle decode rank 0 pings its followers (well within tp_timeout_s)."""
        return min(2.0, self.tp_timeout_s / 4)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=load_model_config(self.model, self.dtype, self.max_model_len,
                                    self.quantization, self.quantization_group_size),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                cache_dtype=self.kv_cache_dtype,
                kv_host_bytes=self.kv_host_bytes,
                kv_disk_path=self.disk_dir(),
                kv_disk_bytes=self.kv_disk_bytes,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens,
                                      step_target_s=self.step_target_s,
                                      scheduling_policy=self.scheduling_policy),
            device=self.device,
            num_threads=self.num_threads,
            seed=self.seed,
            kernel_backend=self.kernel_backend,
            enforce_eager=self.enforce_eager,
            cuda_graph_sizes=tuple(self.cuda_graph_sizes or ()) or None,
            speculative=parse_speculative_config(self.speculative_config),
            lora=self._lora(),
        )

    def disk_dir(self) -> str | None:
        """This worker's disk tier directory, its own under kv_disk_path: a disk tier takes
        every block file in its directory for its own at start-up (and deletes the temp files
        of writes in flight there), so two workers sharing one would evict and delete each
        other's blocks. A restarted worker finds its own again. None: no disk tier."""
        if self.kv_disk_path is None:
            return None
        return str(Path(self.kv_disk_path) / self.worker_id)

    def _lora(self) -> LoRAConfig | None:
        return None if self.lora_config is None else LoRAConfig(**self.lora_config)

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
