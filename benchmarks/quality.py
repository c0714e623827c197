"""Quality: perplexity of a fixed English passage under each serving configuration.

Model: `--model` (default SmolLM2-135M-Instruct, `ensure_default_model()`), CPU, `--threads`
threads. Text: benchmarks/data/passage.txt (~780 SmolLM2 tokens of plain English prose, written
for this benchmark), or `--passage FILE`; `--max-tokens N` keeps its first N tokens.

Each configuration in `--configs` is `DTYPE` or `DTYPE+QUANTIZATION` (e.g. `bfloat16+int4`)
and is built as `LLM(model, dtype=DTYPE, quantization=QUANTIZATION or None,
num_threads=--threads)`. The passage goes in as one prompt with `prompt_logprobs=0`: every
token's log-probability under the raw model distribution at the position before it (the
prefix cache is skipped for such a request, so the whole passage is computed). Perplexity is
exp(-mean logprob) over positions 1..n-1. One configuration at a time is loaded; a
configuration whose LLM raises ValueError (an unknown or unavailable quantization) prints the
error on its row and the run goes on. Columns: perplexity, its ratio to the first
configuration's (the first that loaded), the served weights' bytes (`LLM.weight_bytes`), load
and scoring seconds.

    .venv/bin/python -m benchmarks.quality --threads 2
    .venv/bin/python -m benchmarks.quality --configs bfloat16,float32 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

from pdserve import LLM, SamplingParams
from pdserve.engine.default_model import ensure_default_model

PASSAGE = Path(__file__).resolve().parent / "data" / "passage.txt"
DEFAULT_CONFIGS = "bfloat16,float32,bfloat16+int8,bfloat16+int4,bfloat16+gguf"


def parse_configs(text: str) -> list[tuple[str, str | None]]:
    """"bfloat16,bfloat16+int4" -> [("bfloat16", None), ("bfloat16", "int4")]."""
    configs = []
    for item in text.split(","):
        dtype, _, quantization = item.strip().partition("+")
        if not dtype or (_ and not quantization):
            raise ValueError(f"--configs: {item!r} is not DTYPE or DTYPE+QUANTIZATION")
        configs.append((dtype, quantization or None))
    if not configs:
        raise ValueError("--configs: name at least one configuration")
    return configs


def perplexity(logprobs: list[float]) -> float:
    """exp of minus the mean log-probability."""
    if not logprobs:
        raise ValueError("perplexity needs at least one scored token (a prompt of >= 2)")
    return math.exp(-sum(logprobs) / len(logprobs))


def passage_logprobs(llm: LLM, token_ids: list[int]) -> list[float]:
    """The logprob of each passage token after the first, from prompt_logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([token_ids], params)[0]
    return [entry[token].logprob for token, entry in zip(token_ids[1:], out.prompt_logprobs[1:])]


def measure(model: str, dtype: str, quantization: str | None, token_ids: list[int] | None,
            text: str, max_tokens: int | None, threads: int) -> dict:
    """One configuration's row; `token_ids` None: tokenize `text` with its tokenizer."""
    start = time.perf_counter()
    llm = LLM(model, dtype=dtype, quantization=quantization, num_threads=threads)
    load_s = time.perf_counter() - start
    if token_ids is None:
        token_ids = list(llm.tokenizer(text).input_ids)[:max_tokens]
    start = time.perf_counter()
    logprobs = passage_logprobs(llm, token_ids)
    score_s = time.perf_counter() - start
    row = {"perplexity": perplexity(logprobs), "mean_logprob": sum(logprobs) / len(logprobs),
           "num_tokens": len(token_ids), "weight_bytes": llm.weight_bytes,
           "load_s": load_s, "score_s": score_s, "token_ids": token_ids}
    del llm
    gc.collect()
    return row


def print_row(name: str, row: dict) -> None:
    if "error" in row:
        print(f"{name:<16} error: {row['error']}")
        return
    print(f"{name:<16} {row['perplexity']:>10.4f} {row['ratio']:>7.4f} "
          f"{row['weight_bytes'] / 1e6:>10.1f} {row['load_s']:>7.2f} {row['score_s']:>8.2f}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passage", default=str(PASSAGE))
    ap.add_argument("--max-tokens", type=int, default=None, help="score the first N tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        ap.error(str(exc))
    if args.max_tokens is not None and args.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 (the first token has no logprob)")
    model = args.model or str(ensure_default_model())
    text = Path(args.passage).read_text()
    print(f"model {model}, {args.threads} threads, passage {args.passage}")
    print(f"{'config':<16} {'perplexity':>10} {'ratio':>7} {'weights MB':>10} "
          f"{'load s':>7} {'score s':>8}")
    results: list[dict] = []
    token_ids, first = None, None
    for dtype, quantization in configs:
        name = dtype + (f"+{quantization}" if quantization else "")
        try:
            row = measure(model, dtype, quantization, token_ids, text, args.max_tokens,
                          args.threads)
        except ValueError as exc:
            row = {"error": str(exc)}
        else:
            token_ids = row.pop("token_ids")  # every configuration scores the same tokens
            first = first or row["perplexity"]
            row["ratio"] = row["perplexity"] / first
        print_row(name, row)
        results.append({"config": name, "dtype": dtype, "quantization": quantization, **row})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "passage": args.passage, "results": results}, f,
                      indent=2)
    return results


if __name__ == "__main__":
    main()
