"""Seeded synthetic workloads for the benchmarks, over random token ids.

Every generator draws from numpy `default_rng`: the same arguments give the same requests.
`sharegpt_like` seeds it with `seed`, `grid` and `sessions` with `(seed, 1)` and `(seed, 2)`,
so two workloads of one seed never draw the same token stream (they would share prefixes).
Prompt tokens are uniform random ids in [first_id, vocab_size), skipping the special tokens
at the bottom of the vocabulary, so no prompt contains an end-of-text marker and no two
prompts share a prefix worth a KV block (prefix caching cannot help anyone) — except the turns
of one multi-turn session, which share their whole conversation so far by construction.

`sharegpt_like`: ShareGPT conversations have a right-skewed, roughly log-normal length
distribution: most prompts are a few hundred tokens, a few are long; replies are shorter and
less spread. Both lengths are log-normal, rounded and clipped:

- input length:  LogNormal(mu=ln(150 * scale), sigma=0.9), clipped to [4, 1024 * scale]
- output length: LogNormal(mu=ln(120 * scale), sigma=0.7), clipped to [4, 512 * scale]

so the medians are ~150 and ~120 tokens at scale 1 (means ~215 and ~150: the tail is long).

`grid`: every (input length, output length) combination, `num_per_cell` times, shuffled.

`sessions`: multi-turn conversations. A `BenchRequest` of a session holds only the turn's NEW
user tokens; the prompt actually sent for turn t is the conversation so far:

    prompt_0 = new_0
    prompt_t = prompt_{t-1} + answer_{t-1} + new_t      (answer = the tokens streamed back)

which `turn_prompt(history, request)` builds, with history = prompt_{t-1} + answer_{t-1}
(empty for turn 0 and for requests outside a session). Turns of one session must be sent one
after the other, each after the previous answer is complete, with the session id, so the
router keeps the session on one decode worker and later turns find their prefix cached. With
answers of exactly `output_len` tokens, turn t's prompt has
first_len + t * (output_len + turn_len) tokens.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INPUT_MEDIAN, INPUT_SIGMA, INPUT_MAX = 150, 0.9, 1024
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX = 120, 0.7, 512
MIN_LEN = 4
FIRST_ID = 17  # ids below this are special tokens in SmolLM2's vocabulary


CANCEL, ABORT = "cancel", "abort"  # what an Interrupt does (bench/interrupts.py plans them)


@dataclass(frozen=True)
class Interrupt:
    """Cut one request short once `after_tokens` output tokens have arrived."""

    kind: str  # CANCEL | ABORT
    after_tokens: int

    def __post_init__(self) -> None:
        if self.kind not in (CANCEL, ABORT):
            raise ValueError(f"interrupt kind must be {CANCEL!r} or {ABORT!r}, got {self.kind!r}")
        if self.after_tokens < 1:
            raise ValueError(f"after_tokens must be >= 1 (mid-stream), got {self.after_tokens}")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload; for a session turn, only the turn's new user tokens.

    `prompt_token_ids` is the whole prompt when `continues_session` is False (turn 0, or no
    session), and the tokens to append to the conversation so far otherwise (`turn_prompt`).
    """

    prompt_token_ids: list[int]
    output_len: int  # exactly this many tokens are asked for (EOS ignored)
    session_id: str = ""  # "" = not part of a session
    turn: int = 0  # index within the session
    interrupt: Interrupt | None = None  # cut short mid-stream (bench/interrupts.py)

    def __post_init__(self) -> None:
        if self.turn < 0:
            raise ValueError(f"turn must be >= 0, got {self.turn}")
        if self.turn > 0 and not self.session_id:
            raise ValueError(f"turn {self.turn} needs a session_id: later turns extend a session")

    @property
    def continues_session(self) -> bool:
        """True when `prompt_token_ids` extend the conversation so far instead of replacing it."""
        return self.turn > 0


def turn_prompt(history: Sequence[int], request: BenchRequest) -> list[int]:
    """The prompt to send: `history` (earlier prompts and answers) + the request's new tokens."""
    if not request.continues_session and history:
        raise ValueError(
            f"request {request.session_id or '(no session)'} turn {request.turn} starts a "
            f"conversation but got {len(history)} history tokens; pass an empty history"
        )
    return [*history, *request.prompt_token_ids]


def _check_vocab(vocab_size: int, first_id: int) -> None:
    if vocab_size <= first_id:
        raise ValueError(f"vocab_size ({vocab_size}) must be > first_id ({first_id})")


def _lognormal_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, upper: int
) -> np.ndarray:
    raw = rng.lognormal(math.log(median), sigma, n)
    return np.clip(np.rint(raw), MIN_LEN, max(MIN_LEN, upper)).astype(np.int64)


def sharegpt_like(
    num_requests: int, vocab_size: int, seed: int = 0, scale: float = 1.0,
    first_id: int = FIRST_ID,
) -> list[BenchRequest]:
    """`num_requests` prompts of random token ids with log-normal input/output lengths."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    _check_vocab(vocab_size, first_id)
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


def grid(
    input_lens: Sequence[int], output_lens: Sequence[int], num_per_cell: int, vocab_size: int,
    seed: int, first_id: int = FIRST_ID,
) -> list[BenchRequest]:
    """Every (input, output) length pair `num_per_cell` times, in a seeded random order."""
    if not input_lens or not output_lens:
        raise ValueError("grid needs at least one input length and one output length")
    if min(input_lens) < 1 or min(output_lens) < 1:
        raise ValueError(f"lengths must be >= 1, got inputs {input_lens} outputs {output_lens}")
    if num_per_cell < 1:
        raise ValueError(f"num_per_cell must be >= 1, got {num_per_cell}")
    _check_vocab(vocab_size, first_id)
    rng = np.random.default_rng((seed, 1))
    cells = list(itertools.product(input_lens, output_lens)) * num_per_cell
    order = rng.permutation(len(cells))
    return [
        BenchRequest(rng.integers(first_id, vocab_size, int(cells[i][0])).tolist(),
                     int(cells[i][1]))
        for i in order
    ]


def sessions(
    num_sessions: int, num_turns: int, first_len: int, turn_len: int, output_len: int,
    vocab_size: int, seed: int, first_id: int = FIRST_ID,
) -> list[list[BenchRequest]]:
    """`num_sessions` conversations of `num_turns` turns, ids "bench-<seed>-<i>".

    Turn 0 brings `first_len` new tokens, every later turn `turn_len`; every turn asks for
    `output_len` tokens. See the module docstring for how the runner builds each prompt.
    """
    if num_sessions < 1 or num_turns < 1:
        raise ValueError(f"need >= 1 session and turn, got {num_sessions} x {num_turns}")
    if first_len < 1 or turn_len < 1 or output_len < 1:
        raise ValueError(
            f"lengths must be >= 1, got first_len={first_len} turn_len={turn_len} "
            f"output_len={output_len}"
        )
    _check_vocab(vocab_size, first_id)
    rng = np.random.default_rng((seed, 2))
    out = []
    for i in range(num_sessions):
        sid = f"bench-{seed}-{i}"
        out.append([
            BenchRequest(rng.integers(first_id, vocab_size, first_len if t == 0 else turn_len)
                         .tolist(), output_len, session_id=sid, turn=t)
            for t in range(num_turns)
        ])
    return out
