"""pdserve's decode step against the machine's memory-bandwidth roofline, and the workload
against its compute floor.

A decode step reads every weight once (linears and LM head; the embedding lookup reads a few
rows) and every running sequence's K/V once, so its floor is those bytes over the memory read
bandwidth. Bandwidth: the best of three fp32 sums over 1 GiB of random data (a read stream;
untouched memory would read the shared zero page and fake it). Step: pdserve's own, at
`batch` sequences of `prompt_len` random tokens, the mean over 64 steps (generate 65 tokens
minus generate 1, fresh prompts each time so the prefix cache serves nothing, best of two).
Run in a child of its own with the benchmark's threads.

Compute floor: the workload's matmul FLOPs (each request's prompt and generated positions
through every layer, the LM head once per sampled token, causal attention) over the best rate
a large GEMM reaches here in the serving dtype: no engine finishes the workload faster.
"""

from __future__ import annotations

import time


def _best(fn, tries: int = 3) -> float:
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth() -> float:
    """Bytes per second that a streaming read reaches (fp32 sum over 1 GiB)."""
    import torch

    data = torch.randn(1 << 28)
    data.sum()
    return data.numel() * 4 / _best(data.sum)


def decode_step(opts: dict, batch: int = 32, prompt_len: int = 128) -> dict:
    """One decode step's time and bytes, and the share of the bandwidth floor it reaches."""
    import numpy as np
    import torch

    from pdserve import LLM, SamplingParams

    torch.set_num_threads(opts["threads"])
    llm = LLM(model=opts["model"], dtype=opts["dtype"], num_threads=opts["threads"],
              skip_tokenizer_init=True, kv_cache_memory_bytes=opts["kv_cache_bytes"])
    rng = np.random.default_rng(0)

    def generate(n: int) -> float:
        prompts = [rng.integers(100, opts["vocab_size"], prompt_len).tolist()
                   for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    generate(2)
    step_s = (_best(lambda: generate(65), 2) - _best(lambda: generate(1), 2)) / 64
    model = llm.engine.core.runner.model
    weights = _read_bytes(model)
    kv = batch * (prompt_len + 32) * opts["kv_bytes_per_token"]
    bandwidth = read_bandwidth()
    floor_s = (weights + kv) / bandwidth
    return {"batch": batch, "step_ms": step_s * 1e3, "weights_mb": weights / 1e6,
            "kv_mb": kv / 1e6, "bandwidth_gbs": bandwidth / 1e9, "floor_ms": floor_s * 1e3,
            "roofline_pct": 100 * floor_s / step_s}


def _read_bytes(model) -> int:
    """What a decode step reads of the weights: every linear's prepared kernel, the norms, and
    the LM head's whole matrix (tied or not); the embedding lookup reads only a few rows."""
    from pdserve.engine.models.parallel import ParallelLinear

    tensors = [p for name, p in model.named_parameters()
               if not name.startswith(("embed_tokens", "lm_head"))]
    tensors += [t for m in model.modules() if isinstance(m, ParallelLinear)
                for t in m.kernel.tensors]
    tensors.append(model.lm_head.weight)
    return sum(t.numel() * t.element_size() for t in tensors)


def describe(r: dict) -> str:
    return (f"decode step @ batch {r['batch']}: {r['step_ms']:.1f} ms; memory floor "
            f"{r['floor_ms']:.1f} ms (weights {r['weights_mb']:.0f} MB + KV {r['kv_mb']:.0f} MB "
            f"at {r['bandwidth_gbs']:.1f} GB/s read) -> {r['roofline_pct']:.0f}% of roofline")


GEMM_SIZE = 1024


def gemm_rate(opts: dict) -> float:
    """FLOP/s of the best square GEMM_SIZE matmul in the run's dtype with its threads (oneDNN
    or MKL at their best, and in bf16 also pdserve's packed kernel, which is the only fast
    one on CPUs without AVX512-BF16): an upper bound for any linear layer's rate here."""
    import torch

    from pdserve.kernels.cpu import packed_linear

    torch.set_num_threads(opts["threads"])
    size = GEMM_SIZE
    a, b = (torch.randn(size, size).to(getattr(torch, opts["dtype"])) for _ in range(2))
    candidates = [lambda: torch.mm(a, b)]
    if packed_linear.can_pack(b):
        packed = packed_linear.pack(b.t().contiguous())  # y = a @ b as a linear of b^T
        candidates.append(lambda: packed(a))
    for fn in candidates:
        fn()
    return max(2 * size**3 / _best(fn, 5) for fn in candidates)


def compute_floor(hf: dict, reqs, rate: float) -> dict:
    """The workload's matmul FLOPs (every position through every layer, the LM head once per
    sampled token, causal attention) and the fastest it could run at `rate` FLOP/s."""
    d, layers = hf["hidden_size"], hf["num_hidden_layers"]
    hd = hf.get("head_dim") or d // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * hf["intermediate_size"]
    flops = 0.0
    for r in reqs:
        positions = len(r.prompt_token_ids) + r.output_len - 1
        flops += 2 * layers * per_layer * positions + 2 * d * hf["vocab_size"] * r.output_len
        flops += 4 * layers * q * positions * (positions + 1) / 2  # scores and values
    seconds = flops / rate
    output = sum(r.output_len for r in reqs)
    return {"tflop": flops / 1e12, "gemm_gflops": rate / 1e9, "floor_s": seconds,
            "ceiling_tok_s": output / seconds}


def describe_compute(c: dict) -> str:
    return (f"compute floor: {c['tflop']:.2f} TFLOP of matmuls at {c['gemm_gflops']:.0f} GFLOP/s "
            f"(the best {GEMM_SIZE}^3 GEMM here) = {c['floor_s']:.1f} s -> at most "
            f"{c['ceiling_tok_s']:.0f} output tok/s with nothing else")
