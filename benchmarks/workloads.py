"""Seeded synthetic workloads for the benchmarks: a ShareGPT-like length mix over token ids.

ShareGPT conversations have a right-skewed, roughly log-normal length distribution: most
prompts are a few hundred tokens, a few are long; replies are shorter and less spread. We
draw both lengths from log-normals (numpy `default_rng(seed)`), round, and clip:

- input length:  LogNormal(mu=ln(150 * scale), sigma=0.9), clipped to [4, 1024 * scale]
- output length: LogNormal(mu=ln(120 * scale), sigma=0.7), clipped to [4, 512 * scale]

so the medians are ~150 and ~120 tokens at scale 1 (means ~215 and ~150: the tail is long).
Prompt tokens are uniform random ids in [first_id, vocab_size), skipping the special tokens
at the bottom of the vocabulary, so no two prompts share a prefix (prefix caching cannot help
anyone) and no prompt contains an end-of-text marker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INPUT_MEDIAN, INPUT_SIGMA, INPUT_MAX = 150, 0.9, 1024
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX = 120, 0.7, 512
MIN_LEN = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # exactly this many tokens are asked for (EOS ignored)


def _lognormal_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, upper: int
) -> np.ndarray:
    raw = rng.lognormal(math.log(median), sigma, n)
    return np.clip(np.rint(raw), MIN_LEN, max(MIN_LEN, upper)).astype(np.int64)


def sharegpt_like(
    num_requests: int, vocab_size: int, seed: int = 0, scale: float = 1.0, first_id: int = 17
) -> list[BenchRequest]:
    """`num_requests` prompts of random token ids with log-normal input/output lengths."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = np.random.default_rng(seed)
    in_lens = _lognormal_lengths(
        rng, num_requests, INPUT_MEDIAN * scale, INPUT_SIGMA, int(INPUT_MAX * scale)
    )
    out_lens = _lognormal_lengths(
        rng, num_requests, OUTPUT_MEDIAN * scale, OUTPUT_SIGMA, int(OUTPUT_MAX * scale)
    )
    return [
        BenchRequest(rng.integers(first_id, vocab_size, int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]
