"""Drive a prefill worker and a decode worker the way the router will: reserve on decode,
prefill into the reservation, start decode with the first token, stream the rest."""

from __future__ import annotations

import time

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_config
from engine.sampling_params import SamplingParams

MODEL_NAME = "tiny-llama"


def engine_config(model_dir, num_blocks: int = 256, block_size: int = 16) -> EngineConfig:
    return EngineConfig(
        model=load_model_config(model_dir, max_model_len=512),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        num_threads=1,
    )


def generate_pd(prefill, decode, request_id, prompt, params: SamplingParams, timeout=60.0):
    """Token ids of one request served disaggregated; raises on refusal or failure."""
    deadline = time.time() + timeout
    descriptor = decode.reserve(request_id, prompt, params, [prefill.endpoint], deadline)
    if descriptor is None:
        raise RuntimeError(f"{request_id}: decode refused the reservation")
    first = prefill.prefill(request_id, prompt, params, descriptor).result(timeout)
    decode.start(request_id, first)
    tokens, last = [], None
    for out in decode.stream(request_id, timeout=timeout):
        tokens.extend(out.token_ids)
        last = out
    if last.finish_reason == "error":
        raise RuntimeError(f"{request_id}: {last.error}")
    return tokens


def run_engine(core, prompts, params: SamplingParams) -> list[list[int]]:
    """Every prompt through one in-process EngineCore (the reference the workers must match)."""
    from engine.request import Request

    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", tuple(prompt), params))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]
