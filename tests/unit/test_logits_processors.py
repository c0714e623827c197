"""Logits processing (bad words, min_tokens, logit_bias, penalties) against a per-row,
per-token reference written from vLLM's definitions, on random logits and histories."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.logits_processors import LogitsRow, apply_logits_processors
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs_params import StructuredOutputsParams
from pdserve.wire import sampling_from_proto, sampling_to_proto

VOCAB = 50


def reference(logits: torch.Tensor, rows: list[LogitsRow | None]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        if row is None:
            continue
        p, x = row.params, out[r]
        generated = list(row.all_token_ids)[len(row.all_token_ids) - row.num_generated:]
        for word in p.bad_words_token_ids:
            if len(word) == 1 or (len(generated) >= len(word) - 1
                                  and generated[-(len(word) - 1):] == list(word[:-1])):
                x[word[-1]] = float("-inf")
        if row.num_output < p.min_tokens:
            for t in row.stop_ids:
                x[t] = float("-inf")
        for t, b in p.logit_bias:
            x[t] += b
        for t in set(row.all_token_ids):
            if p.repetition_penalty != 1.0:
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(generated):
            x[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    return out


def random_row(rng: random.Random) -> LogitsRow | None:
    if rng.random() < 0.2:
        return None
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    generated = [rng.randrange(10) for _ in range(rng.randrange(0, 15))]  # repeats likely
    word = tuple(generated[-2:]) + (rng.randrange(VOCAB),) if len(generated) >= 2 else (7,)
    params = SamplingParams(
        max_tokens=64,
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, 2.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(3))},
        min_tokens=rng.randrange(0, 20),
        bad_words_token_ids=rng.choice([(), (word,), (word, (rng.randrange(VOCAB),))]),
    )
    num_output = rng.randrange(0, len(generated) + 1)
    return LogitsRow(params, prompt + generated, len(generated), num_output, (0, 3))


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_reference_on_random_rows(seed):
    rng = random.Random(seed)
    rows = [random_row(rng) for _ in range(rng.randrange(1, 8))]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    expected = reference(logits, rows)
    got = logits.clone()
    apply_logits_processors(got, rows)
    torch.testing.assert_close(got, expected)


def test_each_control_does_what_it_says():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 2.0
    row = LogitsRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                   presence_penalty=0.25, logit_bias={9: 3.0},
                                   bad_words_token_ids=((1, 5), (8,)), min_tokens=2),
                    all_token_ids=(4, 1, 1), num_generated=2, num_output=1, stop_ids=(0,))
    apply_logits_processors(logits, [row])
    assert logits[0, 4] == 1.0  # prompt token, positive: divided by the repetition penalty
    assert logits[0, 1] == -(0.5 * 2 + 0.25)  # generated twice: frequency x2 plus presence
    assert logits[0, 5] == float("-inf")  # the output ends with 1: the word (1, 5) is banned
    assert logits[0, 8] == float("-inf")  # a one-token word: always banned
    assert logits[0, 0] == float("-inf")  # a stop id before min_tokens
    assert logits[0, 9] == 3.0
    assert logits[0, 2] == 0.0  # untouched


def test_sampling_params_check_the_new_fields_by_name():
    for kwargs, field in [({"presence_penalty": 3}, "presence_penalty"),
                          ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                          ({"repetition_penalty": 0}, "repetition_penalty"),
                          ({"logit_bias": {1: 101}}, "logit_bias"),
                          ({"logit_bias": {-1: 1}}, "logit_bias"),
                          ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
                          ({"bad_words": [""]}, "bad_words"),
                          ({"structured_outputs": {"json": "{}", "regex": "a"}},
                           "structured_outputs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={"7": 1}).logit_bias == ((7, 1.0),)


@pytest.mark.parametrize("spec", [
    {"json": '{"type": "object"}'}, {"regex": "a+"}, {"choice": ["x", "y"]},
    {"grammar": 'root ::= "a"'}, {"json_object": True}])
def test_the_controls_cross_the_wire_unchanged(spec):
    params = SamplingParams(max_tokens=9, presence_penalty=0.5, frequency_penalty=-0.25,
                            repetition_penalty=1.1, logit_bias={3: -2.0, 7: 100.0},
                            min_tokens=2, bad_words_token_ids=((1, 2), (3,)),
                            structured_outputs=StructuredOutputsParams(**spec))
    assert sampling_from_proto(sampling_to_proto(params), default_max_tokens=1) == params
    assert sampling_from_proto(sampling_to_proto(SamplingParams()), 16) == SamplingParams()
