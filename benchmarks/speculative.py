"""Speculative decoding: single-request latency on copy-heavy prompts, and batch throughput
on random ShareGPT-like prompts, each with and without speculation, in one process.

Model: SmolLM2-135M-Instruct in `--dtype` (auto: bf16), CPU, `--threads` threads, greedy.
Two engines are loaded side by side (same settings, one with `speculative_config`); every
measurement runs them alternately, `--repeats` times, and reports the median.

- latency: each copy-heavy prompt (a chat: edit code, repeat a list, continue a pattern) alone,
  `--max-tokens` tokens, EOS honoured; per prompt: seconds, output tok/s, the speed-up, the
  drafts' acceptance rate and mean accepted length (tokens per verification, its own included),
  and whether both engines produced the same tokens (bf16: the verify pass runs the prefill
  attention over k+1 tokens, so a near-tie may tip differently than the one-token decode).
- batch: `--batch` requests from `pdserve.bench.workloads.sharegpt_like` (random token ids,
  exact output lengths, EOS ignored) submitted together; output tok/s and the ratio.

    .venv/bin/python -m benchmarks.speculative --threads 2
    .venv/bin/python -m benchmarks.speculative --method draft --draft-model PATH
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdserve import LLM, SamplingParams
from pdserve.bench.workloads import sharegpt_like

CODE = '''def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''
COPY_HEAVY = {
    "code-edit": "Add type hints to this function and return the whole code:\n\n" + CODE,
    "code-rename": "Rename `items` to `values` in this function; return the whole code:\n\n"
                   + CODE,
    "list": "Here is a shopping list:\n- apples\n- bread\n- milk\n- eggs\n- cheese\n"
            "- tomatoes\n- rice\n- coffee\nRepeat the list exactly, in the same format.",
    "json": 'Reformat as pretty-printed JSON with 2-space indent: {"name": "pdserve", '
            '"version": "0.1.0", "workers": {"prefill": 2, "decode": 4}, "dtype": "bfloat16", '
            '"features": ["paged attention", "prefix cache", "speculative decoding"]}',
    "repeat": "Repeat this paragraph word for word: The prefill workers build the KV cache "
              "and ship its blocks to the decode workers, which run continuous batching with "
              "paged attention. The router sends each request to the worker that holds the "
              "longest prefix of its prompt.",
}


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.core.scheduler.stats
    return s.num_spec_verifications, s.num_draft_tokens, s.num_accepted_tokens


def timed(llm: LLM, prompts, params) -> tuple[float, list, tuple[int, int, int]]:
    before = spec_counts(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, outs, tuple(b - a for a, b in zip(before, spec_counts(llm)))


def rates(counts: tuple[int, int, int]) -> tuple[float, float]:
    """(acceptance rate, mean accepted length) of (verifications, drafts, accepted)."""
    verifications, drafts, accepted = counts
    if not verifications:
        return 0.0, 0.0
    return accepted / drafts, (accepted + verifications) / verifications


def compare(plain: LLM, spec: LLM, prompts, params, repeats: int) -> dict:
    times = {"plain": [], "spec": []}
    counts = [0, 0, 0]
    for _ in range(repeats):
        t_plain, want, _ = timed(plain, prompts, params)
        t_spec, got, c = timed(spec, prompts, params)
        times["plain"].append(t_plain)
        times["spec"].append(t_spec)
        counts = [x + y for x, y in zip(counts, c)]
    tokens = sum(len(o.token_ids) for o in got)
    plain_s, spec_s = statistics.median(times["plain"]), statistics.median(times["spec"])
    acceptance, mean_len = rates(tuple(counts))
    return {
        "tokens": tokens, "plain_s": plain_s, "spec_s": spec_s,
        "plain_tok_s": sum(len(o.token_ids) for o in want) / plain_s,
        "spec_tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
        "acceptance": acceptance, "mean_accepted_len": mean_len,
        "same_tokens": [a.token_ids == b.token_ids for a, b in zip(want, got)],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", choices=["ngram", "draft"], default="ngram")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--scale", type=float, default=1.0, help="sharegpt_like length scale")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    config = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "ngram":
        config["prompt_lookup_max"] = args.prompt_lookup_max
    else:
        config["model"] = args.draft_model
    common = {"dtype": args.dtype, "num_threads": args.threads}
    plain, spec = LLM(**common), LLM(**common, speculative_config=config)
    print(f"model {plain.config.model.path} ({plain.config.model.dtype}), "
          f"{args.threads} threads, speculative_config {json.dumps(config)}")
    warm = SamplingParams(temperature=0, max_tokens=16)
    for llm in (plain, spec):
        llm.generate(["Hello, how are you?"] * 2, warm)

    results: dict = {"config": config, "latency": {}, "batch": None}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print(f"\nsingle request, {args.max_tokens} tokens max, median of {args.repeats}")
    print(f"{'prompt':<12} {'tokens':>6} {'plain s':>8} {'spec s':>8} {'plain t/s':>9} "
          f"{'spec t/s':>9} {'speedup':>7} {'accept':>7} {'mean len':>8} same")
    for name, text in COPY_HEAVY.items():
        prompt = plain.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        r = compare(plain, spec, [prompt], params, args.repeats)
        results["latency"][name] = r
        print(f"{name:<12} {r['tokens']:>6} {r['plain_s']:>8.2f} {r['spec_s']:>8.2f} "
              f"{r['plain_tok_s']:>9.1f} {r['spec_tok_s']:>9.1f} {r['speedup']:>6.2f}x "
              f"{r['acceptance']:>6.1%} {r['mean_accepted_len']:>8.2f} {r['same_tokens'][0]}")
    speedups = [r["speedup"] for r in results["latency"].values()]
    print(f"geometric-mean speed-up: {statistics.geometric_mean(speedups):.2f}x")

    reqs = sharegpt_like(args.batch, plain.config.model.vocab_size, seed=0, scale=args.scale)
    prompts = [r.prompt_token_ids for r in reqs]
    batch_params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
                    for r in reqs]
    r = compare(plain, spec, prompts, batch_params, max(1, args.repeats - 1))
    results["batch"] = {k: v for k, v in r.items() if k != "same_tokens"}
    results["batch"]["same_tokens"] = sum(r["same_tokens"])
    print(f"\nbatch of {args.batch} ShareGPT-like prompts ({r['tokens']} output tokens): "
          f"plain {r['plain_tok_s']:.1f} tok/s, speculative {r['spec_tok_s']:.1f} tok/s "
          f"({r['spec_tok_s'] / r['plain_tok_s']:.3f}x), acceptance {r['acceptance']:.1%}, "
          f"mean accepted length {r['mean_accepted_len']:.2f}, "
          f"same tokens {sum(r['same_tokens'])}/{len(prompts)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
