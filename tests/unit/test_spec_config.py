"""parse_speculative_config: a dict, its JSON text, None or '' -> a checked config; every
invalid field is a ValueError that names it."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.spec.config import (
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    parse_speculative_config,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
         "prompt_lookup_min": 2}
DRAFT = {"method": "draft", "num_speculative_tokens": 4, "model": "/models/draft"}


@pytest.mark.parametrize("value", [NGRAM, DRAFT], ids=["ngram", "draft"])
def test_a_dict_and_its_json_give_the_same_config(value: dict) -> None:
    from_dict = parse_speculative_config(dict(value))
    assert from_dict == parse_speculative_config(json.dumps(value))
    for name, field_value in value.items():
        assert getattr(from_dict, name) == field_value
    assert from_dict.to_dict() == {**from_dict.to_dict(), **value}
    assert parse_speculative_config(from_dict.to_dict()) == from_dict  # round trip


def test_defaults_fill_the_fields_left_out() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    assert config == SpeculativeConfig("ngram", 2)
    assert config.model is None
    assert 1 <= config.prompt_lookup_min <= config.prompt_lookup_max


@pytest.mark.parametrize("value", [None, "", "   \n"], ids=["none", "empty", "blank"])
def test_nothing_means_no_speculation(value) -> None:
    assert parse_speculative_config(value) is None


def test_a_config_passes_through() -> None:
    config = SpeculativeConfig("ngram", 1)
    assert parse_speculative_config(config) is config


@pytest.mark.parametrize("k", [1, MAX_SPECULATIVE_TOKENS])
def test_num_speculative_tokens_bounds_are_inclusive(k: int) -> None:
    assert parse_speculative_config({**NGRAM, "num_speculative_tokens": k}) is not None


def test_prompt_lookup_min_may_equal_max() -> None:
    config = parse_speculative_config({**NGRAM, "prompt_lookup_min": 5, "prompt_lookup_max": 5})
    assert config.prompt_lookup_min == config.prompt_lookup_max == 5


@pytest.mark.parametrize(
    "value,field",
    [
        ({**NGRAM, "method": "eagle"}, "method"),
        ({**NGRAM, "method": None}, "method"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1},
         "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_max": 0, "prompt_lookup_min": 1}, "prompt_lookup_max"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_min": 6, "prompt_lookup_max": 5}, "prompt_lookup_min"),
        ({"method": "draft", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft", "num_speculative_tokens": 2, "model": ""}, "model"),
        ({**NGRAM, "model": "/models/draft"}, "model"),
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
    ],
    ids=["unknown-method", "method-none", "k-zero", "k-negative", "k-above-max", "k-float",
         "k-string", "k-bool", "max-zero", "min-zero", "min-above-max", "draft-no-model",
         "draft-empty-model", "ngram-with-model", "no-method", "no-k"],
)
def test_every_invalid_field_is_named(value: dict, field: str) -> None:
    named = rf"speculative_config\.{field}\b"
    with pytest.raises(ValueError, match=named):
        parse_speculative_config(value)
    with pytest.raises(ValueError, match=named):  # the same from the JSON text
        parse_speculative_config(json.dumps(value))


@pytest.mark.parametrize("name", ["num_speculative_token", "draft_model", "speculative_method"])
def test_an_unknown_field_is_named(name: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown field.*'{name}'"):
        parse_speculative_config({**NGRAM, name: 3})


@pytest.mark.parametrize("text", ['{"method": "ngram",', "ngram", "{'method': 'ngram'}"])
def test_bad_json_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="speculative_config.*JSON"):
        parse_speculative_config(text)


@pytest.mark.parametrize("value", ["[1, 2]", '"ngram"', "3", [("method", "ngram")], 3])
def test_anything_but_an_object_is_a_value_error(value) -> None:
    with pytest.raises(ValueError, match="speculative_config"):
        parse_speculative_config(value)


def test_the_constructor_checks_like_the_parser() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", 2, prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig("draft", 2)
