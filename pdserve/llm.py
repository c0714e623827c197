"""LLM: the offline API. `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    load_model_config,
)
from pdserve.engine.default_model import DEFAULT_MODEL, resolve_model
from pdserve.engine.input_processor import Prompt, chat_prompt
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec.config import SpeculativeConfig, parse_speculative_config
from pdserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLM:
    """A whole engine in this process: load once, then generate for batches of prompts.

    `model` is an HF-format directory or a known name (default: the bundled SmolLM2).
    `tokenizer` names another directory to take the tokenizer from; with
    `skip_tokenizer_init=True` no tokenizer is loaded: prompts are token ids, outputs carry
    token ids and empty text, and stop strings and `chat` are refused.
    `speculative_config` turns on speculative decoding, as vLLM's does: a dict such as
    `{"method": "ngram", "num_speculative_tokens": 4}`, its JSON text, or a
    SpeculativeConfig (engine/spec/config.py); a bad field is a ValueError naming it.
    `quantization` serves weight-only quantized linears (engine/quantization.py): "int8" or
    "int4" quantized at load (`quantization_group_size` for int4, default 32), "gguf" from the
    model directory's GGUF file, "gptq"/"awq" (found from the checkpoint's config.json).
    `enable_lora=True` serves LoRA adapters (PEFT directories) over the base model, as vLLM's:
    `generate(..., lora_request=LoRARequest(name, int_id, path))`, one for every prompt or a
    list with one (or None) per prompt; up to `max_loras` adapters of rank <= `max_lora_rank`
    run in one step, `max_cpu_loras` stay in host memory.
    On CUDA, decode steps replay CUDA graphs captured at start-up for the batch sizes
    `cuda_graph_sizes` (default: 1, 2, 4, 8, 16, ... up to max_num_seqs), each step padded to
    the next; `enforce_eager=True` captures none, as vLLM's (engine/cuda_graphs.py).
    `kv_host_bytes` keeps prefix-cache blocks in host memory once the device pool evicts them,
    and `kv_disk_path` / `kv_disk_bytes` on local disk below that (engine/kv_tiers.py): a
    prefix found there is copied back, not recomputed.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int = 1 << 30,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        num_threads: int | None = None,
        device: str = "cpu",
        seed: int = 0,
        kernel_backend: str | None = None,
        tokenizer: str | None = None,
        skip_tokenizer_init: bool = False,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        quantization: str | None = None,
        quantization_group_size: int = 0,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        enforce_eager: bool = False,
        cuda_graph_sizes: Sequence[int] | None = None,
        kv_host_bytes: int = 0,
        kv_disk_path: str | None = None,
        kv_disk_bytes: int = 0,
    ) -> None:
        speculative = parse_speculative_config(speculative_config)  # refused before any load
        path = resolve_model(model)
        config = EngineConfig(
            model=load_model_config(path, dtype, max_model_len, quantization,
                                    quantization_group_size),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                num_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,
                kv_host_bytes=kv_host_bytes,
                kv_disk_path=kv_disk_path,
                kv_disk_bytes=kv_disk_bytes,
            ),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            device=device,
            num_threads=num_threads,
            seed=seed,
            kernel_backend=kernel_backend,
            speculative=speculative,
            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
            enforce_eager=enforce_eager,
            cuda_graph_sizes=None if cuda_graph_sizes is None else tuple(cuda_graph_sizes),
        )
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(path, tokenizer)
        self.engine = LLMEngine(config, self.tokenizer)
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def weight_bytes(self) -> int:
        """Bytes of this engine's weights as served (quantized linears at their packed size)."""
        return self.engine.core.runner.weight_bytes

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        Every prompt is validated before any is queued: one bad prompt raises ValueError
        and nothing runs.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts),
                             "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        prepared = [
            self.engine.prepare(f"offline-{next(self._ids)}", prompt, p, lora)
            for prompt, p, lora in zip(prompts, params, loras)
        ]
        return self._run(prepared)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {role, content}) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [chat_prompt(conv, self.tokenizer) for conv in conversations]
        return self.generate(prompts, sampling_params, lora_request)

    def _run(self, prepared: list) -> list[RequestOutput]:
        for request in prepared:
            self.engine.add_prepared(request)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(prepared):
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            for request in prepared:  # on an interrupt, leave nothing allocated
                if request.request_id not in finished:
                    self.engine.abort(request.request_id)
        return [finished[r.request_id] for r in prepared]


def _per_prompt(value, num_prompts: int, name: str) -> list:
    """One value for every prompt, or a list with one per prompt."""
    if value is None or not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"{name}: got {len(value)} for {num_prompts} prompts")
    return list(value)
