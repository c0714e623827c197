"""Measure a real engine in this process and fit a `PerfModel`.

Prefill: for each prompt length, one fresh random-token prompt with max_tokens=1 is stepped
to completion (`LLMEngine.step()`, timed), `repeats` times; the rate is total tokens / total
seconds over all lengths (the medians per length). Decode: for each (batch, context) cell,
`batch` random prompts of `context` tokens are added with ignore_eos and stepped until every
one has its first token (untimed); `WARMUP_STEPS` more warm up, then `decode_steps` steps that
advance the whole batch are timed one by one and their median is the point (batch, mean
context during those steps, seconds). The requests are then aborted, freeing their blocks.
`fit_decode` turns the points into step_s = a + b*batch + c*batch*context.

Random token ids (never the special ids at the bottom of the vocabulary) give no prefix-cache
hits, so every token is computed. One warm-up prefill runs first (first-call allocations).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdserve.engine.sampling_params import SamplingParams
from pdserve.planner.perf_model import PerfModel, fit_decode

logger = logging.getLogger(__name__)

FIRST_ID = 17  # ids below this are special tokens in SmolLM2's vocabulary
DEFAULT_PREFILL_LENS = (128, 512)
DEFAULT_BATCH_SIZES = (1, 8)
DEFAULT_CONTEXTS = (64, 256)
WARMUP_STEPS = 2  # untimed decode steps per cell


def _engine(llm_or_engine_factory: Any) -> Any:
    """The LLMEngine behind an `LLM`, an `LLMEngine`, or a zero-argument factory of either."""
    obj = llm_or_engine_factory
    if callable(obj) and not hasattr(obj, "step") and not hasattr(obj, "engine"):
        obj = obj()
    engine = getattr(obj, "engine", obj)
    if not hasattr(engine, "step") or not hasattr(engine, "add_request"):
        raise ValueError(f"profile needs an LLM, an LLMEngine or a factory of one, got {obj!r}")
    return engine


class _Profiler:
    def __init__(self, engine: Any, seed: int) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.ids = itertools.count()
        model = engine.config.model
        self.vocab_size, self.max_model_len = model.vocab_size, model.max_model_len

    def add(self, num_tokens: int, max_tokens: int) -> str:
        rid = f"profile-{next(self.ids)}"
        prompt = self.rng.integers(FIRST_ID, self.vocab_size, num_tokens).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def prefill_seconds(self, num_tokens: int) -> float:
        rid = self.add(num_tokens, max_tokens=1)
        start = time.perf_counter()
        done = False
        while not done:
            done = any(o.request_id == rid and o.finished for o in self.engine.step())
        return time.perf_counter() - start

    def decode_point(self, batch: int, context: int, steps: int) -> tuple[int, float, float]:
        rids = [self.add(context, max_tokens=self.max_model_len - context) for _ in range(batch)]
        produced = dict.fromkeys(rids, 0)
        try:
            while min(produced.values()) == 0:  # prefill, possibly in chunks: untimed
                for out in self.engine.step():
                    produced[out.request_id] += len(out.delta_token_ids)
            times, contexts = [], []
            for i in range(steps + WARMUP_STEPS):
                ctx = context + sum(produced.values()) / batch
                start = time.perf_counter()
                outs = self.engine.step()
                elapsed = time.perf_counter() - start
                if len(outs) != batch:
                    raise RuntimeError(f"decode step advanced {len(outs)} of {batch} sequences; "
                                       f"is the KV cache or max_num_seqs too small?")
                for out in outs:
                    produced[out.request_id] += len(out.delta_token_ids)
                if i >= WARMUP_STEPS:  # a new batch shape's first steps allocate
                    times.append(elapsed)
                    contexts.append(ctx)
        finally:
            for rid in rids:
                self.engine.abort(rid)
        return batch, statistics.fmean(contexts), statistics.median(times)


def _check_grid(engine: Any, prefill_lens: Sequence[int], batch_sizes: Sequence[int],
                contexts: Sequence[int], decode_steps: int, repeats: int) -> None:
    if not prefill_lens or not batch_sizes or not contexts:
        raise ValueError("profile needs at least one prefill length, batch size and context")
    if min(*prefill_lens, *batch_sizes, *contexts) < 1 or decode_steps < 1 or repeats < 1:
        raise ValueError("prefill lengths, batch sizes, contexts, decode_steps and repeats "
                         "must all be >= 1")
    config = engine.config
    # tokens a sequence may reach: early ones decode while later prompts still prefill
    prefill_steps = math.ceil(max(batch_sizes) * max(contexts)
                              / config.scheduler.max_num_batched_tokens)
    decode_len = max(contexts) + prefill_steps + WARMUP_STEPS + decode_steps + 2
    longest = max(max(prefill_lens), decode_len)
    if longest > config.model.max_model_len:
        raise ValueError(f"profile needs {longest} tokens per sequence but the model's "
                         f"max_model_len is {config.model.max_model_len}; use shorter lengths")
    if max(batch_sizes) > config.scheduler.max_num_seqs:
        raise ValueError(f"batch size {max(batch_sizes)} > the engine's max_num_seqs "
                         f"({config.scheduler.max_num_seqs})")
    need = max(batch_sizes) * decode_len
    have = config.cache.num_blocks * config.cache.block_size
    if need > have:
        raise ValueError(f"the decode grid needs {need} KV tokens, the cache holds {have}; "
                         f"give the engine more KV memory or use a smaller grid")


def profile(
    llm_or_engine_factory: Any | Callable[[], Any],
    prefill_lens: Sequence[int] = DEFAULT_PREFILL_LENS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    decode_steps: int = 4,
    repeats: int = 1,
    seed: int = 0,
    source: dict[str, Any] | None = None,
) -> PerfModel:
    """Profile the engine (see the module docstring) and fit a `PerfModel`; `source` is
    stored with it (e.g. model and threads)."""
    engine = _engine(llm_or_engine_factory)
    _check_grid(engine, prefill_lens, batch_sizes, contexts, decode_steps, repeats)
    prof = _Profiler(engine, seed)
    prof.prefill_seconds(min(prefill_lens))  # warm-up
    seconds = {n: statistics.median(prof.prefill_seconds(n) for _ in range(repeats))
               for n in prefill_lens}
    rate = sum(prefill_lens) / sum(seconds[n] for n in prefill_lens)
    for n in prefill_lens:
        logger.info("prefill %d tokens: %.4f s (%.0f tok/s)", n, seconds[n], n / seconds[n])
    points = []
    for batch, context in itertools.product(batch_sizes, contexts):
        point = prof.decode_point(batch, context, decode_steps)
        logger.info("decode batch %d context %.0f: %.4f s/step", *point)
        points.append(point)
    a, b, c = fit_decode(points)
    info = {"prefill_seconds": {str(n): s for n, s in seconds.items()},
            "decode_points": [list(p) for p in points], **(source or {})}
    return PerfModel(rate, a, b, c, source=info)
