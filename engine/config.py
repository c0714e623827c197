"""Frozen configuration of one engine: the model, the KV cache, the scheduler.

Derived values (the number of KV blocks, the context window) come from functions that return
a new config, never from mutation.

Why one file: the configs check each other (the pool must hold one context of the model, CUDA
graph sizes must fit the scheduler's batch, tiers exclude a draft model), and one engine's
whole configuration reads in one place, as vLLM's EngineArgs and its configs do.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.engine.models import SUPPORTED_ARCHITECTURES
from pdserve.engine.quantization import (
    Quantization,
    checkpoint_method,
    has_gguf,
    resolve_quantization,
)
from pdserve.engine.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
CACHE_DTYPES = ("auto", "int8")
SCHEDULING_POLICIES = ("fcfs", "srpt")  # engine.step_budget.srpt_order for "srpt"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """What the network looks like, read from an HF config.json."""

    path: str
    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    quantization: Quantization | None = None  # weight-only (engine/quantization.py)
    # per layer: the sliding attention window in tokens, or None (the whole context)
    layer_windows: tuple[int | None, ...] = ()
    # transformers' config object: the architecture's own fields, read by its model class
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures: {self.architecture!r} is not supported; "
                f"supported: {SUPPORTED_ARCHITECTURES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not 0 < self.max_model_len <= self.max_position_embeddings:
            raise ValueError(
                f"max_model_len must be in [1, {self.max_position_embeddings}] "
                f"(the model's max_position_embeddings), got {self.max_model_len}"
            )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window; None where it cuts nothing (full attention, or a
        window no shorter than max_model_len: no context is long enough to leave it)."""
        window = self.layer_windows[layer] if self.layer_windows else None
        return window if window is not None and window < self.max_model_len else None

    @property
    def latent_dim(self) -> int:
        """A latent (MLA) cache's entry per token and layer, kv_lora_rank + qk_rope_head_dim
        (`kernels.reference.latent_attention`); 0 for per-head K/V caches."""
        rank = getattr(self.hf_config, "kv_lora_rank", None)
        return rank + self.hf_config.qk_rope_head_dim if rank else 0

    def kv_bytes_per_token(self, cache_dtype: str = "auto") -> int:
        """K and V of every layer for one token (a latent cache: its one entry); int8 adds one
        fp16 scale per token and head (the format of kernels.kv_quant)."""
        if self.latent_dim:
            return self.num_layers * self.latent_dim * _DTYPE_BYTES[self.dtype]
        if cache_dtype == "int8":
            per_head = self.head_dim + 2
        else:
            per_head = self.head_dim * _DTYPE_BYTES[self.dtype]
        return 2 * self.num_layers * self.num_kv_heads * per_head


def load_model_config(
    path: str | Path, dtype: str = "auto", max_model_len: int | None = None,
    quantization: str | None = None, quantization_group_size: int = 0,
) -> ModelConfig:
    """Read config.json through transformers' AutoConfig; refuse what the network can't run.

    `dtype="auto"` is the checkpoint's own (config.json `dtype` / `torch_dtype`), as vLLM's
    "auto"; float32 when the checkpoint names none or one the engine does not run.
    """
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(path))
    if dtype == "auto":
        dtype = checkpoint_dtype(hf)
    arch = (getattr(hf, "architectures", None) or ["?"])[0]
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    max_positions = hf.max_position_embeddings
    if max_model_len is None:
        max_model_len = max_positions
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        path=str(path),
        architecture=arch,
        dtype=dtype,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_parameters=_rope_parameters(hf),
        max_position_embeddings=max_positions,
        max_model_len=max_model_len,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf, "attention_bias", False)),
        eos_token_ids=eos_ids,
        quantization=resolve_quantization(quantization, checkpoint_method(hf), has_gguf(path),
                                          quantization_group_size),
        layer_windows=layer_windows(hf),
        hf_config=hf,
    )


def num_experts(hf) -> int:
    """Qwen3-MoE names it num_experts, Mixtral num_local_experts."""
    return getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", 0) or 0


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether layer `index` routes to experts: every layer of Mixtral; Qwen3-MoE's layers
    outside `mlp_only_layers` at every `decoder_sparse_step`-th place."""
    hf = cfg.hf_config
    if hf is None or not num_experts(hf):
        return False
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return index not in (getattr(hf, "mlp_only_layers", None) or ()) and (index + 1) % step == 0


def checkpoint_dtype(hf: Any) -> str:
    """The dtype an HF config names for its weights, as one of DTYPES (float32 if none)."""
    named = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else "float32"
    return name if name in DTYPES else "float32"


def layer_windows(hf: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers applies them: by
    `layer_types` where the config has them (Gemma 2/3, Qwen2/3), else one `sliding_window` for
    every layer (Mistral, Mixtral, Phi-3), unless `use_sliding_window` is false."""
    window = getattr(hf, "sliding_window", None) or None
    types = getattr(hf, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if getattr(hf, "use_sliding_window", True) is False:
        window = None
    return (window,) * hf.num_hidden_layers


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """transformers 5 keeps rope_theta and scaling in `rope_parameters`; older configs split."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    return params


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. `num_blocks` None means: derive it from `kv_cache_memory_bytes`."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # "auto": the model's dtype; "int8": quantized, per-token scales
    # The tiers under the device pool (engine.kv_tiers): prefix blocks written through to host
    # memory, and demoted from there to local disk, instead of lost on eviction. 0: no tier.
    kv_host_bytes: int = 0
    kv_disk_path: str | None = None  # a directory of its own; needs the host tier
    kv_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}")
        self._check_tiers()

    def _check_tiers(self) -> None:
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a byte count >= 0, got {value!r}")
        if (self.kv_disk_path is None) != (self.kv_disk_bytes == 0):
            raise ValueError("kv_disk_path and kv_disk_bytes go together: a directory and how "
                             f"much of it to use (got {self.kv_disk_path!r}, {self.kv_disk_bytes})")
        if self.kv_disk_bytes and not self.kv_host_bytes:
            raise ValueError("kv_disk_bytes: the disk tier takes blocks demoted from host "
                             "memory; set kv_host_bytes too")
        if self.kv_host_bytes and not self.enable_prefix_caching:
            raise ValueError("kv_host_bytes: the KV tiers keep prefix-cache blocks; they need "
                             "enable_prefix_caching")

    @property
    def tiered(self) -> bool:
        return self.kv_host_bytes > 0


def with_num_blocks(
    cache: CacheConfig, model: ModelConfig, draft: ModelConfig | None = None
) -> CacheConfig:
    """Size the pool from the memory budget; refuse a pool that can't hold one full context.

    A draft model (speculative decoding) keeps its own KV in the same blocks: each block then
    costs both models' bytes."""
    per_token = model.kv_bytes_per_token(cache.cache_dtype)
    if draft is not None:
        per_token += draft.kv_bytes_per_token(cache.cache_dtype)
    bytes_per_block = cache.block_size * per_token
    num_blocks = cache.num_blocks or cache.kv_cache_memory_bytes // bytes_per_block
    if num_blocks * cache.block_size < model.max_model_len:
        raise ValueError(
            f"kv_cache_memory_bytes: {num_blocks} blocks x {cache.block_size} tokens can't hold "
            f"one max_model_len={model.max_model_len} context; raise the KV budget or lower "
            "max_model_len"
        )
    logger.info(
        "KV cache: %d blocks x %d tokens, %.1f KiB per block, %d tokens of capacity (%.2f GiB)",
        num_blocks, cache.block_size, bytes_per_block / 1024, num_blocks * cache.block_size,
        num_blocks * bytes_per_block / 2**30,
    )
    return replace(cache, num_blocks=num_blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (chunked prefill).

    `step_target_s` also sizes steps in time (engine.step_budget): once a couple of steps have
    been timed, a step takes only the tokens that should last about that long (decodes
    always run, prefill makes at least a block of progress), so a burst of prompts is
    prefilled over several short steps and the first ones get their first token early. None:
    the token budget alone. `scheduling_policy` orders admission: "fcfs" (arrival order) or
    "srpt" (shortest remaining prefill first, aged by waiting time so long prompts still go).
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    step_target_s: float | None = None
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        target = self.step_target_s
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 < target < math.inf):
            raise ValueError(f"step_target_s must be a number of seconds > 0 (or None: token "
                             f"budget only), got {target!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", got {self.scheduling_policy!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (vLLM's `--enable-lora` family): up to `max_loras` adapters in one
    step, each of rank <= `max_lora_rank`, held in device slots; `max_cpu_loras` loaded adapters
    kept in host memory (default: max_loras), least recently used dropped beyond that."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {cpu!r}")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


MAX_DEFAULT_GRAPH_SIZE = 512  # vLLM's cap: bigger batches gain little from a graph


def default_cuda_graph_sizes(max_batch: int) -> tuple[int, ...]:
    """vLLM's capture sizes: 1, 2, 4, then every multiple of 8, up to the largest decode batch
    (at most 512), which is itself captured so that every batch up to it replays."""
    top = min(max_batch, MAX_DEFAULT_GRAPH_SIZE)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top}))


def check_cuda_graph_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Capture sizes as given (`--cuda-graph-sizes`): positive integers, ascending, unique."""
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"cuda_graph_sizes must be positive integers, got {list(sizes)!r}")
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"cuda_graph_sizes must be ascending and unique, got {list(sizes)!r};"
                         f" e.g. {sorted(set(sizes))}")
    return tuple(sizes)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs; `device` is a torch device string.

    CUDA graphs (engine.cuda_graphs): on CUDA, decode steps replay graphs captured at start-up
    for each of `cuda_graph_sizes` (None: `default_cuda_graph_sizes`), a step padded to the next
    size; `enforce_eager=True` captures none (vLLM's switch). `emulate_cuda_graphs=True` takes
    the graphs' path without capturing (each replay runs the forward eagerly on the static
    buffers), on any device: how CPU tests cover the padding and replay bookkeeping CUDA uses,
    and on CUDA a way to tell a capture bug from a padding bug.
    """

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    num_threads: int | None = None
    seed: int = 0
    kernel_backend: str | None = None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    lora: LoRAConfig | None = None  # None: no LoRA adapters (enable_lora=False)
    enforce_eager: bool = False  # True: no CUDA graphs, every step eager
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode batch sizes captured; None: default
    emulate_cuda_graphs: bool = False  # the graphs' path, capture a no-op (tests, debugging)

    def __post_init__(self) -> None:
        if self.num_threads is not None and not 1 <= self.num_threads <= (os.cpu_count() or 1):
            raise ValueError(
                f"num_threads must be in [1, {os.cpu_count()}], got {self.num_threads}"
            )
        self._check_cuda_graphs()
        if self.cache.cache_dtype == "int8" and self.model.latent_dim:
            raise ValueError("kv_cache_dtype: int8 quantizes per-head K/V caches; this model's "
                             "cache is a latent (MLA): use auto")
        if self.cache.tiered and self.speculative is not None and self.speculative.model:
            raise ValueError("kv_host_bytes: the KV tiers keep the target model's KV only, "
                             "not a draft model's; use speculative method ngram or no tiers")

    def _check_cuda_graphs(self) -> None:
        for name in ("enforce_eager", "emulate_cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.enforce_eager and self.emulate_cuda_graphs:
            raise ValueError("emulate_cuda_graphs takes the CUDA graphs' path, which "
                             "enforce_eager=True turns off: set one of them")
        sizes = self.cuda_graph_sizes
        if sizes is None:
            return
        if not isinstance(sizes, tuple):
            raise ValueError(f"cuda_graph_sizes must be a tuple, got {sizes!r}")
        check_cuda_graph_sizes(sizes)
        if sizes[-1] > self.max_decode_batch:
            raise ValueError(
                f"cuda_graph_sizes: {sizes[-1]} exceeds the largest decode batch "
                f"{self.max_decode_batch} (max_num_seqs, max_num_batched_tokens): no step "
                "would replay it; drop it or raise max_num_seqs")

    @property
    def max_decode_batch(self) -> int:
        """The most single-token sequences one step can hold."""
        return min(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)

    @property
    def capture_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes graphs are captured for (ascending)."""
        if self.cuda_graph_sizes is not None:
            return self.cuda_graph_sizes
        return default_cuda_graph_sizes(self.max_decode_batch)

    @property
    def cuda_graph_mode(self) -> str | None:
        """How decode steps run: "cuda" (captured graphs replayed), "emulated" (the same
        path, each replay run eagerly) or None (eager, no padding: CPUs by default)."""
        if self.enforce_eager:
            return None
        if self.emulate_cuda_graphs:
            return "emulated"
        return "cuda" if self.device.split(":")[0] == "cuda" else None
