"""The three systems `offline_throughput.py` compares, each as a loader that returns its `run`.

`RUNNERS[system](reqs, warm, opts)` loads the model (not timed) and returns
`run(batch) -> (token ids per request, tokens computed, wall seconds)`; it runs in the
benchmark's spawned child, one system per child. How each system is driven, and why, is in
offline_throughput.py's docstring.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.bench.workloads import BenchRequest

PDSERVE, HF_GENERATE, HF_BATCH = "pdserve", "hf generate", "hf generate_batch"
BLOCK_SIZE = 16
PAD_TOKEN_ID = 2  # SmolLM2's <|im_end|>: only fills masked positions


def run_pdserve(reqs: list[BenchRequest], warm: list[BenchRequest], opts: dict) -> Any:
    from pdserve import LLM, SamplingParams

    llm = LLM(
        model=opts["model"],
        dtype=opts["dtype"],
        block_size=BLOCK_SIZE,
        max_model_len=opts["max_model_len"],
        kv_cache_memory_bytes=opts["kv_cache_bytes"],
        max_num_seqs=opts["max_num_seqs"],
        max_num_batched_tokens=opts["max_batched_tokens"],
        num_threads=opts["threads"],
        quantization=opts.get("quantization"),
    )

    def run(batch: list[BenchRequest]) -> tuple[list[list[int]], int, float]:
        start = time.perf_counter()
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in batch
        ]
        outs = llm.generate([r.prompt_token_ids for r in batch], params)
        elapsed = time.perf_counter() - start
        return [list(o.token_ids) for o in outs], sum(len(o.token_ids) for o in outs), elapsed

    return run


def hf_dtype(requested: str, dtype: str) -> str:
    """transformers' dtype: `requested`, or for "auto" every system's, except bf16 where torch
    has no bf16 matmul kernel (no oneDNN bf16: on AVX2-only CPUs a 0.8 GFLOP/s reference loop,
    about an hour for the default workload): there float32, what a transformers user runs."""
    if requested != "auto":
        return requested
    from pdserve.kernels.cpu.packed_linear import onednn_bf16

    return "float32" if dtype == "bfloat16" and not onednn_bf16() else dtype


def _load_hf(opts: dict) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(opts["model_path"],
                                                 dtype=getattr(torch, opts["hf_dtype"]))
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: never a stopping criterion
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    return model


def _hf_batches(reqs: list[BenchRequest], size: int, sort: bool) -> list[list[int]]:
    order = list(range(len(reqs)))
    if sort:
        order.sort(key=lambda i: (reqs[i].output_len, len(reqs[i].prompt_token_ids)), reverse=True)
    return [order[i : i + size] for i in range(0, len(order), size)]


def run_hf_generate(reqs: list[BenchRequest], warm: list[BenchRequest], opts: dict) -> Any:
    import torch
    from transformers import GenerationConfig

    model = _load_hf(opts)

    @torch.inference_mode()
    def run(batch: list[BenchRequest]) -> tuple[list[list[int]], int, float]:
        start = time.perf_counter()
        tokens: list[list[int]] = [[] for _ in batch]
        computed = 0
        for idx in _hf_batches(batch, opts["hf_batch_size"], opts["hf_sort"]):
            prompts = [batch[i].prompt_token_ids for i in idx]
            width = max(map(len, prompts))
            ids = torch.full((len(idx), width), PAD_TOKEN_ID, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, p in enumerate(prompts):  # left padding
                ids[row, width - len(p) :] = torch.tensor(p)
                mask[row, width - len(p) :] = 1
            max_new = max(batch[i].output_len for i in idx)
            cfg = GenerationConfig(
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=None,
                pad_token_id=PAD_TOKEN_ID,
            )
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            new = out[:, width:].tolist()  # [batch, max_new]
            computed += sum(len(r) for r in new)
            for row, i in enumerate(idx):
                tokens[i] = new[row][: batch[i].output_len]
        return tokens, computed, time.perf_counter() - start

    return run


def run_hf_batch(reqs: list[BenchRequest], warm: list[BenchRequest], opts: dict) -> Any:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _load_hf(opts)
    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID)
    page_size = 256  # ContinuousBatchingConfig's default
    cb_cfg = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=max(1, opts["kv_cache_bytes"] // (page_size * opts["kv_bytes_per_token"])),
        max_batch_tokens=opts["max_batched_tokens"],
    )

    # no inference_mode here: the manager's thread updates tensors made in this one
    def run(batch: list[BenchRequest]) -> tuple[list[list[int]], int, float]:
        with model.continuous_batching_context_manager(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30
        ) as manager:
            # timed from the first request to the last result: cache allocation, thread
            # start and the stop/cleanup in __exit__ are left out, as pdserve's are
            start = time.perf_counter()
            add = manager.add_request
            ids = [
                add(r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1) for r in batch
            ]
            if None in ids:
                raise RuntimeError("generate_batch's manager refused a request")
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                out = manager.get_result(timeout=1)
                if out is not None and out.error is not None:
                    raise RuntimeError(f"generate_batch failed a request: {out.error}")
                if out is not None and out.is_finished():
                    done[out.request_id] = list(out.generated_tokens)
                elif out is None and not manager.is_running():
                    raise RuntimeError("generate_batch's generation thread died")
            elapsed = time.perf_counter() - start
        tokens = [done[i] for i in ids]
        return tokens, sum(map(len, tokens)), elapsed

    return run


RUNNERS = {PDSERVE: run_pdserve, HF_GENERATE: run_hf_generate, HF_BATCH: run_hf_batch}
