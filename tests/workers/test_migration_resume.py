"""A migrated request continues its stream exactly (issue 18, decode-death migration).

A request whose decode worker died is placed again with what it had streamed as its prompt's
tail (`num_output_tokens` of them) and max_tokens less that many. Here, on the tiny fp32
model, such a continuation must give exactly the tokens the undisturbed run gives after that
point: greedy, and seeded sampling (its generator skips the draws already made), whether the
engine runs it alone, a prefill worker samples its next token and the decode worker goes on
(loopback transport), or the decode worker prefills it itself (Submit). And the field is
checked where it enters a worker: an integer in [0, prompt length).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs_params import StructuredOutputsParams
from tests.workers.pd import engine_config, loopback_pair, run_engine, streams

MAX_TOKENS = 12
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=77, max_tokens=MAX_TOKENS,
                             ignore_eos=True),
    # a grammar (an array too long to end within max_tokens) and every penalty: the matcher
    # and the counts replay the streamed tokens
    "constrained": SamplingParams(
        temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2, structured_outputs=StructuredOutputsParams(
            json='{"type": "array", "items": {"type": "integer"}, "minItems": 40}')),
}
PROMPTS = [list(range(200, 230)), list(range(300, 305)), list(range(40, 77))]
CUTS = (1, 5, MAX_TOKENS - 1)  # tokens streamed before the decode worker died


@pytest.fixture(scope="module")
def undisturbed(tiny_llama_dir) -> dict[str, list[list[int]]]:
    """Every prompt's tokens from one engine, per sampling kind."""
    return {kind: run_engine(EngineCore(engine_config(tiny_llama_dir)), PROMPTS, params)
            for kind, params in PARAMS.items()}


@pytest.fixture()
def workers(tiny_llama_dir):
    with loopback_pair(tiny_llama_dir) as pair:
        yield pair


def continued(kind: str, prompt: list[int], done: list[int]) -> tuple[list[int], SamplingParams]:
    """The prompt and params of a request taken over after `done` tokens were streamed."""
    params = PARAMS[kind]
    return prompt + done, dataclasses.replace(params, max_tokens=params.max_tokens - len(done))


def test_sampling_differs_from_the_seed_start(undisturbed, tiny_llama_dir) -> None:
    """The seeded case tests something: its continuation is not what a fresh seed gives; the
    constrained one is the grammar's (a JSON array of integers)."""
    assert undisturbed["seeded"] != undisturbed["greedy"]
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).decode(
        undisturbed["constrained"][0])
    assert text.startswith("[") and set(text[1:]) <= set("0123456789-, \n"), text


@pytest.mark.parametrize("kind", PARAMS)
def test_engine_continues_the_stream(tiny_llama_dir, undisturbed, kind) -> None:
    core = EngineCore(engine_config(tiny_llama_dir))
    expected, got = {}, {}
    for i, prompt in enumerate(PROMPTS):
        for k in CUTS:
            full = undisturbed[kind][i]
            prompt2, params = continued(kind, prompt, full[:k])
            core.add_request(Request(f"r{i}-{k}", tuple(prompt2), params,
                                     num_prior_output_tokens=k))
            expected[f"r{i}-{k}"], got[f"r{i}-{k}"] = full[k:], []
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id].extend(out.new_token_ids)
    assert got == expected
    assert core.kv_cache.num_free_blocks == core.config.cache.num_blocks


@pytest.mark.parametrize("kind", PARAMS)
def test_prefill_then_decode_continue_the_stream(undisturbed, workers, kind) -> None:
    """The prefill worker samples token k+1 (k draws skipped), decode goes on from k+2."""
    prefill, decode = workers
    for i, prompt in enumerate(PROMPTS):
        for k in CUTS:
            full = undisturbed[kind][i]
            prompt2, params = continued(kind, prompt, full[:k])
            rid = f"{kind}-{i}-{k}"
            descriptor = decode.reserve(rid, prompt2, params, [prefill.endpoint],
                                        time.time() + 60, num_output_tokens=k)
            assert descriptor is not None
            first = prefill.prefill(rid, prompt2, params, descriptor,
                                    num_output_tokens=k).result(60)
            assert first.first_token == full[k], (rid, first.first_token, full)
            decode.start(rid, first.first_token, first.logprobs)
            tokens, last = streams(decode).collect(rid, 60)
            assert (tokens, last.finish_reason) == (full[k:], "length"), rid
    assert decode.stats().num_used_blocks == 0
    assert prefill.stats().num_used_blocks == 0


@pytest.mark.parametrize("kind", PARAMS)
def test_decode_prefilling_itself_continues_the_stream(undisturbed, workers, kind) -> None:
    _, decode = workers
    for i, prompt in enumerate(PROMPTS):
        k = 5
        full = undisturbed[kind][i]
        prompt2, params = continued(kind, prompt, full[:k])
        assert decode.submit(f"s{i}", prompt2, params, num_output_tokens=k)
        tokens, last = streams(decode).collect(f"s{i}", 60)
        assert (tokens, last.finish_reason) == (full[k:], "length")
    assert decode.stats().num_used_blocks == 0


@pytest.mark.parametrize("bad", [-1, len(PROMPTS[0]), len(PROMPTS[0]) + 3, True, 2.5, "3"])
def test_bad_num_output_tokens_is_refused_by_every_entry(workers, bad) -> None:
    prefill, decode = workers
    prompt, params = PROMPTS[0], PARAMS["greedy"]
    with pytest.raises(ValueError, match="num_output_tokens"):
        decode.reserve("bad", prompt, params, [prefill.endpoint], time.time() + 60,
                       num_output_tokens=bad)
    with pytest.raises(ValueError, match="num_output_tokens"):
        decode.submit("bad", prompt, params, num_output_tokens=bad)
    descriptor = decode.reserve("ok", prompt, params, [prefill.endpoint], time.time() + 60)
    with pytest.raises(ValueError, match="num_output_tokens"):
        prefill.prefill("ok", prompt, params, descriptor, num_output_tokens=bad)
    assert decode.abort("ok")
    assert decode.stats().num_used_blocks == 0 and decode.stats().num_reserved == 0
    assert prefill.stats().num_used_blocks == 0
