"""SamplingParams: every bound raises ValueError naming the field; defaults are valid."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.engine.sampling_params import SamplingParams


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert not params.greedy
    assert params.stop == () and params.stop_token_ids == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1.0"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("seed", -1),
        ("seed", 1.0),
        ("logprobs", -1),
        ("logprobs", SamplingParams.MAX_LOGPROBS + 1),
        ("logprobs", 2.0),
        ("logprobs", True),
        ("prompt_logprobs", -1),
        ("prompt_logprobs", SamplingParams.MAX_LOGPROBS + 1),
        ("prompt_logprobs", 1.0),
        ("prompt_logprobs", False),
        ("stop_token_ids", (5, -1)),
        ("stop_token_ids", ("7",)),
    ],
)
def test_bad_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("stop", [("",), ("ok", ""), (1,), ("ok", None)])
def test_bad_stop_raises(stop: tuple) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"seed": 0},
        {"logprobs": 0},
        {"logprobs": SamplingParams.MAX_LOGPROBS},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": SamplingParams.MAX_LOGPROBS},
    ],
)
def test_values_at_the_bounds_are_valid(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_stop_is_normalised_to_a_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_greedy_means_temperature_zero() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
