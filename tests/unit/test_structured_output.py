"""Structured outputs with SmolLM2's real tokenizer: whatever is sampled under the mask parses
and validates; replay, drafts and the kernel agree with their one-by-one references."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from benchmarks.structured import SCHEMAS as BENCHMARK_SCHEMAS
from pdserve.engine.config import load_model_config
from pdserve.engine.structured_output import (
    GrammarCompiler,
    GrammarState,
    StructuredOutputsParams,
    allocate_bitmask,
    check_structured_outputs,
)
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.kernels.reference.token_bitmask import apply_token_bitmask_ref

# The benchmark's schemas, and one more. Every schema forces a finite output (bounded strings,
# arrays and integers; strict objects), so random sampling under the mask ends.
SCHEMAS = {
    **BENCHMARK_SCHEMAS,
    # xgrammar 0.2.8 compiles this only with its cache off (GrammarCompiler falls back).
    "pattern": {"type": "object", "properties": {
        "words": {"type": "string", "pattern": "^[a-z ]{0,200}$"}}, "required": ["words"]},
}
REGEX = r"[A-Z]{2}-\d{2,4}( [a-z]{1,5})?"
CHOICES = ("yes", "no", 'say "hi"', "two\nlines", "café ☕")
EBNF = 'root ::= num (op num){0,3}\nop ::= " + " | "*"\nnum ::= [1-9] [0-9]{0,2} | "0"'
EBNF_MATCH = r"(?:[1-9]\d{0,2}|0)(?:(?: \+ |\*)(?:[1-9]\d{0,2}|0)){0,3}"
MAX_STEPS = 400
CLOSE_AFTER = 24  # steps; then closing tokens get a bias, so an unbounded grammar ends too


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return load_tokenizer(smollm2_dir), load_model_config(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(model):
    tokenizer, config = model
    compiler = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)
    yield compiler
    compiler.close()


def sample(compiler, tokenizer, stop_ids, params, seed) -> tuple[str, bool]:
    """Random tokens under the mask until a stop token: (text, whether the grammar ended)."""
    state = GrammarState(compiler.submit(params))
    gen = torch.Generator().manual_seed(seed)
    closers = [ids[0] for t in ('"', "}", "]", "0", '"}', "}}")
               if len(ids := tokenizer.encode(t)) == 1] + list(stop_ids)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    tokens: list[int] = []
    for step in range(MAX_STEPS):
        logits = torch.randn(1, compiler.vocab_size, generator=gen) * 3  # [1, V]
        if step >= CLOSE_AFTER:
            logits[0, closers] += 20.0
        state.fill_bitmask(bitmask, 0)
        apply_token_bitmask_ref(logits, bitmask)
        noise = torch.empty_like(logits[0]).exponential_(generator=gen)
        token = int(torch.argmax(logits[0] - noise.log()))  # a draw from softmax (Gumbel-max)
        state.accept([token])
        if token in stop_ids:
            assert state.terminated
            return tokenizer.decode(tokens, clean_up_tokenization_spaces=False), True
        tokens.append(token)
    return tokenizer.decode(tokens), False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_validates(model, compiler, name):
    tokenizer, config = model
    params = StructuredOutputsParams(json=json.dumps(SCHEMAS[name]))
    for seed in range(2):
        text, ended = sample(compiler, tokenizer, config.eos_token_ids, params, seed)
        assert ended, text
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        assert text == json.dumps(json.loads(text), ensure_ascii=False) or "\\" in text


@pytest.mark.parametrize("params, check", [
    (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
    (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    (StructuredOutputsParams(grammar=EBNF), lambda text: re.fullmatch(EBNF_MATCH, text)),
    (StructuredOutputsParams(json_object=True),
     lambda text: isinstance(json.loads(text), dict)),
], ids=["regex", "choice", "grammar", "json_object"])
def test_sampled_text_matches(model, compiler, params, check):
    tokenizer, config = model
    for seed in range(3):
        text, ended = sample(compiler, tokenizer, config.eos_token_ids, params, seed)
        assert ended and check(text), repr(text)


def valid_tokens(tokenizer) -> list[int]:
    """A valid output of SCHEMAS["nested"], tokenized as the model would write it."""
    return tokenizer.encode(json.dumps({"user": {"name": "Ada L", "age": 36}, "active": True}))


def test_replay_equals_accepting_one_by_one(model, compiler):
    tokenizer, config = model
    future = compiler.submit(StructuredOutputsParams(json=json.dumps(SCHEMAS["nested"])))
    tokens = valid_tokens(tokenizer) + [config.eos_token_ids[0]]
    stepped = GrammarState(future)
    want, got = allocate_bitmask(1, config.vocab_size), allocate_bitmask(
        1, config.vocab_size)
    for k in range(len(tokens)):
        stepped.fill_bitmask(want, 0)
        GrammarState(future, replay=tokens[:k]).fill_bitmask(got, 0)
        assert torch.equal(want, got), k
        stepped.accept([tokens[k]])
    assert stepped.terminated and GrammarState(future, replay=tokens).terminated


def reference_draft_masks(future, prefix, drafts, vocab_size) -> torch.Tensor:
    """Row j: the mask after prefix + drafts[:j], by accepting one token at a time."""
    state = GrammarState(future, replay=prefix)
    rows = allocate_bitmask(len(drafts) + 1, vocab_size)
    for j in range(len(drafts) + 1):
        state.fill_bitmask(rows, j)
        if j < len(drafts):
            state.accept([drafts[j]])
    return rows


def test_draft_bitmasks_equal_one_by_one_and_roll_back(model, compiler):
    tokenizer, config = model
    future = compiler.submit(StructuredOutputsParams(json=json.dumps(SCHEMAS["nested"])))
    tokens = valid_tokens(tokenizer) + [config.eos_token_ids[0]]
    for k in (0, 3, len(tokens) - 4, len(tokens) - 2):
        drafts = tokens[k:k + 4]  # the last window ends with the stop token
        state = GrammarState(future, replay=tokens[:k])
        before = allocate_bitmask(1, config.vocab_size)
        state.fill_bitmask(before, 0)
        got = allocate_bitmask(len(drafts) + 2, config.vocab_size)
        state.fill_draft_bitmasks(got, 1, drafts)
        want = reference_draft_masks(future, tokens[:k], drafts, config.vocab_size)
        assert torch.equal(got[1:], want), k
        assert torch.equal(got[0], torch.full_like(got[0], -1))  # rows outside stay as they were
        after = allocate_bitmask(1, config.vocab_size)
        state.fill_bitmask(after, 0)
        assert torch.equal(before, after) and not state.terminated
        state.accept(tokens[k:])  # the state still follows the real tokens
        assert state.terminated


def test_rejected_draft_repeats_its_row(model, compiler):
    tokenizer, config = model
    future = compiler.submit(StructuredOutputsParams(json=json.dumps(SCHEMAS["nested"])))
    tokens = valid_tokens(tokenizer)
    bad = tokenizer.encode("}")[0]  # "{" then "}": the schema requires "user"
    drafts = [tokens[0], bad, tokens[1], tokens[2]]
    state = GrammarState(future)
    got = allocate_bitmask(len(drafts) + 1, config.vocab_size)
    state.fill_draft_bitmasks(got, 0, drafts)
    want = reference_draft_masks(future, [], drafts[:1], config.vocab_size)
    assert torch.equal(got[:2], want)
    assert all(torch.equal(got[j], got[1]) for j in range(2, len(drafts) + 1))
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        state.accept(drafts[:2])


def test_vocab_past_the_tokenizer_is_never_allowed(model):
    tokenizer, config = model
    padded = GrammarCompiler(tokenizer, config.vocab_size + 64, config.eos_token_ids)
    try:
        bitmask = allocate_bitmask(1, padded.vocab_size)
        GrammarState(padded.submit(StructuredOutputsParams(json_object=True))).fill_bitmask(
            bitmask, 0)
        logits = torch.zeros(1, padded.vocab_size)
        apply_token_bitmask_ref(logits, bitmask)
        assert torch.isinf(logits[0, config.vocab_size:]).all()
        assert torch.isfinite(logits[0, :config.vocab_size]).any()
    finally:
        padded.close()


def test_cache_reuses_a_compiled_grammar(compiler):
    params = StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {
        "cached": {"type": "integer", "minimum": 0, "maximum": 7}}, "required": ["cached"]}))
    first = compiler.submit(params).result()
    size = compiler.cache_bytes
    again = compiler.submit(StructuredOutputsParams(json=params.json)).result()
    assert compiler.cache_bytes == size  # found, not compiled and stored again
    assert str(again.grammar) == str(first.grammar)
    other = compiler.submit(StructuredOutputsParams(regex=r"\d{3}")).result()
    assert compiler.cache_bytes > size
    assert str(other.grammar) != str(first.grammar)


def test_failed_compile_is_the_states_error(compiler):
    state = GrammarState(compiler.submit(StructuredOutputsParams(grammar="root ::= missing")))
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: .*missing"):
        state.accept([1])
    assert state.ready and state.error.startswith("structured_outputs.grammar: ")
    good = GrammarState(compiler.submit(StructuredOutputsParams(regex="a")))
    good.accept([])
    assert good.error is None


@pytest.mark.parametrize("params, message", [
    (dict(json="{not json"), "structured_outputs.json: not valid JSON"),
    (dict(json="5"), "structured_outputs.json: a JSON Schema is an object or a boolean"),
    (dict(json='{"type": 5}'), "structured_outputs.json: not a valid JSON Schema at type"),
    (dict(json='{"properties": {"a": {"$ref": "#/nope"}}}'), "structured_outputs.json: "),
    (dict(regex="(ab"), "structured_outputs.regex: Regex parsing error"),
    (dict(regex="(?<=a)b"), "structured_outputs.regex: "),
    (dict(grammar='root ::= "a'), "structured_outputs.grammar: EBNF lexer error"),
    (dict(grammar='start ::= "a"'), "structured_outputs.grammar: "),
])
def test_check_refuses_with_the_field_path(params, message):
    with pytest.raises(ValueError) as info:
        check_structured_outputs(StructuredOutputsParams(**params))
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text and len(text) < 300, text


@pytest.mark.parametrize("params", [
    dict(json=json.dumps(schema)) for schema in SCHEMAS.values()
] + [dict(json="true"), dict(regex=REGEX), dict(choice=CHOICES),
     dict(choice=["a", "b"]), dict(grammar=EBNF), dict(json_object=True),
     dict(json='{"$schema": "http://json-schema.org/draft-07/schema#", "type": "string"}')])
def test_check_passes_good_ones(params):
    check_structured_outputs(StructuredOutputsParams(**params))


def test_params_are_the_torch_free_ones():
    from pdserve.engine import structured_outputs_params

    assert StructuredOutputsParams is structured_outputs_params.StructuredOutputsParams
