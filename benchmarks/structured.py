"""Structured outputs: grammar compile time, the per-step cost of the token mask, and the
engine's decode step with and without a JSON schema.

- compile: each schema below (and a regex, a choice, an EBNF grammar, json_object) compiled
  cold (a fresh GrammarCompiler each, after its one-time setup) and again from the cache, through
  `submit().result()` as the engine waits for it; ms, median of `--repeats`.
- mask: B requests (B = 8, 32) part-way through the schemas' outputs (token sequences sampled
  at random under the mask, one schema per row in turn); each step fills every row's mask,
  masks the [B, V] fp32 logits (the cpu backend's C kernel) and accepts each row's next token;
  ms per step for each part, V the default model's vocabulary.
- engine: `LLM` decode steps at batch 8 and 32, plain (ignore_eos) vs
  `structured_outputs=StructuredOutputsParams(json=PERSON)`, run alternately
  `--engine-repeats` times: the median and lower-quartile ms of the steps in which all B
  requests decoded a token (the quartile for a shared machine, whose neighbours' bursts slow
  single steps many-fold), the ratios, and how many outputs validate. Prints "engine
  integration missing" where SamplingParams has no `structured_outputs` field.

    .venv/bin/python -m benchmarks.structured --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import torch

from pdserve.engine.config import load_model_config
from pdserve.engine.default_model import ensure_default_model
from pdserve.engine.structured_output import (
    GrammarCompiler,
    GrammarState,
    StructuredOutputsParams,
    allocate_bitmask,
)
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.kernels.cpu.token_bitmask import apply_token_bitmask_cpu

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"]},
        "active": {"type": "boolean"}},
        "required": ["user"]},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "count": {"const": 3}},
        "required": ["color", "size", "count"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
              "minItems": 1, "maxItems": 4},
    "strings": {"type": "object", "properties": {
        "code": {"type": "string", "minLength": 2, "maxLength": 6},
        "note": {"type": "string", "maxLength": 10}},
        "required": ["code", "note"]},
    "integers": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "y": {"type": "integer", "minimum": 10, "maximum": 99}},
        "required": ["x", "y"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}},
        "type": "object", "properties": {
            "a": {"$ref": "#/$defs/point"},
            "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}},
        "required": ["a", "b", "items"]},
}
# What the engine part asks for: long enough (bio >= 40 characters) that the first ~40 steps
# decode the whole batch.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                "minItems": 2, "maxItems": 5},
    "bio": {"type": "string", "minLength": 40, "maxLength": 200}},
    "required": ["name", "age", "city", "hobbies", "bio"]}
OTHERS = {
    "regex": StructuredOutputsParams(regex=r"[A-Z]{2}-\d{2,4}( [a-z]{1,5})?"),
    "choice": StructuredOutputsParams(choice=("yes", "no", "maybe")),
    "grammar": StructuredOutputsParams(
        grammar='root ::= num (op num){0,3}\nop ::= " + " | "*"\nnum ::= [0-9]{1,3}'),
    "json_object": StructuredOutputsParams(json_object=True),
}


def all_params() -> dict[str, StructuredOutputsParams]:
    schemas = {**SCHEMAS, "person": PERSON}
    return {**{name: StructuredOutputsParams(json=json.dumps(s)) for name, s in schemas.items()},
            **OTHERS}


def compile_times(tokenizer, config, repeats: int) -> dict[str, dict[str, float]]:
    """ms to compile each grammar cold and then from the cache. Cold: a fresh compiler per
    grammar (xgrammar shares work between grammars of one compiler), its one-time setup
    spent first on a trivial choice."""
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for name, params in all_params().items():
            compiler = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)
            compiler.submit(StructuredOutputsParams(choice=("warm-up",))).result()
            row = times.setdefault(name, {"cold": [], "cached": []})
            for key in ("cold", "cached"):
                start = time.perf_counter()
                compiler.submit(params).result()
                row[key].append((time.perf_counter() - start) * 1e3)
            compiler.close()
    return {name: {k: statistics.median(v) for k, v in row.items()}
            for name, row in times.items()}


def sampled_tokens(compiler: GrammarCompiler, params, seed: int, max_steps: int = 256):
    """A whole output of `params` (its stop token left off), random tokens under the mask."""
    state, gen = GrammarState(compiler.submit(params)), torch.Generator().manual_seed(seed)
    bitmask, tokens = allocate_bitmask(1, compiler.vocab_size), []
    for _ in range(max_steps):
        logits = torch.randn(1, compiler.vocab_size, generator=gen)  # [1, V]
        state.fill_bitmask(bitmask, 0)
        apply_token_bitmask_cpu(logits, bitmask)
        token = int(logits.argmax())
        state.accept([token])
        if state.terminated:
            return tokens
        tokens.append(token)
    raise RuntimeError(f"no end in {max_steps} tokens: {params}")


def mask_step_times(compiler: GrammarCompiler, batch: int, steps: int,
                    repeats: int) -> dict[str, float]:
    """ms per step to fill B masks, apply them and accept B tokens (medians over repeats).

    Row r replays a sampled output of schema r mod len(SCHEMAS), starting over (a new state,
    built off the clock) when it ends, so every step has B requests mid-output."""
    params = [StructuredOutputsParams(json=json.dumps(s)) for s in SCHEMAS.values()]
    outputs = [sampled_tokens(compiler, params[r % len(params)], r) for r in range(batch)]
    bitmask = allocate_bitmask(batch, compiler.vocab_size)
    logits = torch.randn(batch, compiler.vocab_size)  # [B, V]
    parts: dict[str, list[float]] = {"fill": [], "apply": [], "accept": []}
    for _ in range(repeats):
        states: list = [None] * batch
        spent = dict.fromkeys(parts, 0.0)
        for step in range(steps):
            for r, tokens in enumerate(outputs):
                if step % len(tokens) == 0:
                    states[r] = GrammarState(compiler.submit(params[r % len(params)]))
                    states[r].accept([])  # waits for the grammar, builds the matcher
            t0 = time.perf_counter()
            for r, state in enumerate(states):
                state.fill_bitmask(bitmask, r)
            t1 = time.perf_counter()
            apply_token_bitmask_cpu(logits, bitmask)
            t2 = time.perf_counter()
            for state, tokens in zip(states, outputs):
                state.accept([tokens[step % len(tokens)]])
            t3 = time.perf_counter()
            for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                spent[key] += dt
        for key in parts:
            parts[key].append(spent[key] / steps * 1e3)
    result = {key: statistics.median(v) for key, v in parts.items()}
    result["total"] = sum(result.values())
    return result


def engine_step_overhead(threads: int, dtype: str, batches: list[int], max_tokens: int,
                         repeats: int):
    """Median decode-step ms of the offline engine, plain vs a JSON schema, per batch size;
    None where the engine has no `structured_outputs` yet."""
    from pdserve import LLM, SamplingParams

    def structured(seed: int, tokens: int = max_tokens):
        return SamplingParams(temperature=0.8, seed=seed, max_tokens=tokens,
                              structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON)))

    try:
        structured(0)
    except TypeError as exc:
        print(f"\nengine integration missing: {exc}")
        return None
    llm = LLM(dtype=dtype, num_threads=threads)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a fictional person. Reply with JSON only: name, "
                                     "age, city, hobbies and a short bio."}],
        tokenize=False, add_generation_prompt=True)
    llm.generate([prompt] * 2, [SamplingParams(max_tokens=8), structured(0, 8)])  # + compile
    results = {}
    for batch in batches:
        # Plain requests run to the limit; 64 steps are enough for the median.
        plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=min(64, max_tokens),
                                ignore_eos=True) for i in range(batch)]
        steps: dict[str, list[float]] = {"plain": [], "json": []}
        outputs: list[str] = []
        for _ in range(repeats):  # alternately: the machine's load drifts
            steps["plain"] += decode_steps(llm, prompt, plain)[0]
            json_steps, texts = decode_steps(llm, prompt, [structured(i) for i in range(batch)])
            steps["json"] += json_steps
            outputs += texts
        results[batch] = {"valid": sum(map(validates, outputs)), "of": len(outputs)}
        for stat, fn in (("median", statistics.median), ("p25", lower_quartile)):
            plain_ms, json_ms = fn(steps["plain"]), fn(steps["json"])
            results[batch].update({f"plain_{stat}_ms": plain_ms, f"json_{stat}_ms": json_ms,
                                   f"{stat}_ratio": json_ms / plain_ms})
    return results


def decode_steps(llm, prompt: str, params: list) -> tuple[list[float], list[str]]:
    """Run one batch step by step: the ms of each step in which every request decoded one
    token (no prefill in them), and the outputs' texts."""
    engine, times, texts = llm.engine, [], {}
    ids = [f"structured-bench-{time.monotonic_ns()}-{i}" for i in range(len(params))]
    for rid, p in zip(ids, params):
        engine.add_prepared(engine.prepare(rid, prompt, p))
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        if len(outs) == len(params) and all(len(o.token_ids) > 1 for o in outs):
            times.append(seconds * 1e3)
        texts.update((o.request_id, o.text) for o in outs if o.finished)
    return times, [texts[r] for r in ids]


def lower_quartile(values: list[float]) -> float:
    """Steps a neighbour's burst of load slowed (seconds, on a shared machine) move it least."""
    return statistics.quantiles(values, n=4)[0]


def validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name")), "unknown")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=64, help="mask steps timed per repeat")
    ap.add_argument("--max-tokens", type=int, default=192, help="structured requests' limit")
    ap.add_argument("--engine-repeats", type=int, default=2)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine part")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model_dir = ensure_default_model()
    tokenizer, config = load_tokenizer(model_dir), load_model_config(model_dir)
    print(f"cpu: {cpu_name()}; model {model_dir.name}, vocabulary {config.vocab_size}")

    results: dict = {"compile": compile_times(tokenizer, config, args.repeats), "mask": {}}
    print(f"\ngrammar compile, ms (median of {args.repeats})")
    print(f"{'grammar':<12} {'cold':>8} {'cached':>8} {'ratio':>7}")
    for name, row in results["compile"].items():
        print(f"{name:<12} {row['cold']:>8.2f} {row['cached']:>8.3f} "
              f"{row['cold'] / row['cached']:>6.0f}x")

    compiler = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)
    print(f"\nmask per step, ms ({args.steps} steps, median of {args.repeats}; fp32 logits "
          "on CPU, the cpu backend's C kernel)")
    print(f"{'batch':>5} {'fill':>8} {'apply':>8} {'accept':>8} {'total':>8} "
          f"{'per row':>8}")
    for batch in args.batches:
        r = results["mask"][batch] = mask_step_times(compiler, batch, args.steps, args.repeats)
        print(f"{batch:>5} {r['fill']:>8.3f} {r['apply']:>8.3f} "
              f"{r['accept']:>8.3f} {r['total']:>8.3f} {r['total'] / batch:>8.4f}")
    compiler.close()

    if not args.no_engine:
        results["engine"] = engine_step_overhead(args.threads, args.dtype, args.batches,
                                                 args.max_tokens, args.engine_repeats)
        if results["engine"]:
            print(f"\nengine decode step, ms, over the steps decoding the whole batch "
                  f"({args.threads} threads; json: {args.max_tokens} tokens max; valid: outputs "
                  "that parse and validate)")
            print(f"{'batch':>5} {'plain':>8} {'json':>8} {'ratio':>7} {'plain p25':>9} "
                  f"{'json p25':>9} {'ratio':>7} {'valid':>7}")
            for batch, r in results["engine"].items():
                print(f"{batch:>5} {r['plain_median_ms']:>8.2f} {r['json_median_ms']:>8.2f} "
                      f"{r['median_ratio']:>6.3f}x {r['plain_p25_ms']:>9.2f} "
                      f"{r['json_p25_ms']:>9.2f} {r['p25_ratio']:>6.3f}x "
                      f"{r['valid']:>3}/{r['of']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
