"""Structured outputs in the engine: the real 135M model writes no JSON of its own and valid
JSON under a schema; the grammar wins where other controls would leave no token; a grammar
that fails to compile ends its request with the reason and frees its blocks."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import pytest

from pdserve import LLM, SamplingParams, StructuredOutputsParams
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import Request
from pdserve.engine.structured_output import GrammarState
from tests.workers.pd import engine_config

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "rain": {"type": "boolean"}},
     "required": ["city", "rain"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["mood", "score"], "additionalProperties": False},
]


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_smollm2_writes_valid_json_only_under_a_schema(smollm2_dir):
    llm = LLM(str(smollm2_dir), max_model_len=512, num_kv_blocks=128, num_threads=2)
    prompt = "Tell me about the weather today."
    free = llm.generate([prompt] * 3, [SamplingParams(temperature=0.8, seed=s, max_tokens=48)
                                       for s in range(3)])
    assert not any(parses(o.text) for o in free)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
              for s, schema in enumerate(SCHEMAS)]
    for out, schema in zip(llm.generate([prompt] * 3, params), SCHEMAS):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), max_model_len=512, num_kv_blocks=64, num_threads=1)


def test_bad_words_and_min_tokens_within_a_grammar(tiny):
    """A banned tokenization leaves the grammar others; a min_tokens the grammar cannot meet
    gives way once the grammar allows only its end (the row would have no token left)."""
    (yes,) = tiny.tokenizer.encode("yes", add_special_tokens=False)
    forced = StructuredOutputsParams(choice=["yes"])
    plain, banned, early = tiny.generate(["x"] * 3, [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=forced),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=forced,
                       bad_words=["yes"]),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=forced, min_tokens=6)])
    assert plain.text == banned.text == early.text == "yes"
    assert yes not in banned.token_ids and len(banned.token_ids) > 1
    assert early.finish_reason == "stop" and len(early.token_ids) < 6


def test_a_grammar_that_fails_to_compile_ends_its_request(tiny_llama_dir):
    core = EngineCore(engine_config(tiny_llama_dir))
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(ValueError("structured_outputs.json: injected"))
    bad = Request("bad", tuple(range(5, 40)), SamplingParams(max_tokens=4))
    bad.grammar = GrammarState(failed)  # as the compiler thread would leave it
    core.add_request(bad)
    core.add_request(Request("good", tuple(range(5, 40)),
                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    ends = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason:
                ends[out.request_id] = (out.finish_reason, out.error)
    assert ends == {"bad": ("error", "structured_outputs.json: injected"),
                    "good": ("length", None)}
    assert core.kv_cache.num_free_blocks == core.config.cache.num_blocks
