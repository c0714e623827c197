"""Router-side validation of Generate requests against the tiny checkpoint's real tokenizer."""

from __future__ import annotations

import pytest

from pdserve.engine.input_processor import chat_prompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2, raw_pb2
from pdserve.router.validation import (
    MAX_ID_CHARS,
    MAX_REQUEST_ID_CHARS,
    InvalidArgument,
    ModelContext,
    RequestLimits,
    ValidRequest,
    parse_generate_request,
    validate,
)

MAX_MODEL_LEN = 512
BAD_UTF8 = b"ok \xff\xfe no"


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=MAX_MODEL_LEN)


def request(**kwargs) -> pdserve_pb2.GenerateRequest:
    sampling = kwargs.pop("sampling", None)
    if isinstance(sampling, dict):
        sampling = pdserve_pb2.SamplingParams(**sampling)
    return pdserve_pb2.GenerateRequest(sampling=sampling, **kwargs)


def chat(*pairs: tuple[str, str]) -> list[pdserve_pb2.ChatMessage]:
    return [pdserve_pb2.ChatMessage(role=r, content=c) for r, c in pairs]


def refused(ctx: ModelContext, **kwargs) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate(request(**kwargs), ctx)
    return str(info.value)


def test_model_context_reads_the_checkpoint(model) -> None:
    assert model.name == "tiny"
    assert model.max_model_len == MAX_MODEL_LEN
    assert model.vocab_size == len(model.tokenizer)
    assert model.eos_token_ids == (2,)


# ---- prompt forms ----


def test_text_prompt_is_tokenized_like_the_tokenizer(model) -> None:
    text = "Hello there, how are you? 😀"
    valid = validate(request(prompt=text), model)
    assert isinstance(valid, ValidRequest)
    assert valid.prompt_token_ids == tuple(model.tokenizer(text).input_ids)
    assert model.tokenizer.decode(list(valid.prompt_token_ids)) == text


def test_token_prompt_is_taken_as_given(model) -> None:
    ids = [1, 5, 100, model.vocab_size - 1]
    assert validate(request(prompt_token_ids=ids), model).prompt_token_ids == tuple(ids)


def test_messages_get_the_chat_template(model) -> None:
    pairs = (("system", "Be brief."), ("user", "Hi!"), ("assistant", "Hello."), ("user", "Why?"))
    valid = validate(request(messages=chat(*pairs)), model)
    as_dicts = [{"role": r, "content": c} for r, c in pairs]
    assert valid.prompt_token_ids == tuple(chat_prompt(as_dicts, model.tokenizer))
    text = model.tokenizer.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=True)
    assert valid.prompt_token_ids == tuple(
        model.tokenizer(text, add_special_tokens=False).input_ids
    )
    assert model.tokenizer.decode(list(valid.prompt_token_ids)).endswith("<|im_start|>assistant\n")


def test_messages_with_empty_content_are_allowed(model) -> None:
    assert validate(request(messages=chat(("user", ""))), model).prompt_token_ids


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"prompt_token_ids": []},
        {"messages": []},
    ],
)
def test_no_prompt_is_refused(model, kwargs) -> None:
    message = refused(model, **kwargs)
    assert message.startswith("prompt: give exactly one of")
    assert "got none" in message


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt, prompt_token_ids"),
        ({"prompt": "a", "messages": chat(("user", "b"))}, "prompt, messages"),
        ({"prompt_token_ids": [1], "messages": chat(("user", "b"))}, "prompt_token_ids, messages"),
        ({"prompt": "", "prompt_token_ids": [1]}, "prompt, prompt_token_ids"),
    ],
)
def test_two_prompts_are_refused(model, kwargs, named: str) -> None:
    message = refused(model, **kwargs)
    assert message.startswith("prompt: give exactly one of")
    assert f"(got {named})" in message


def test_empty_text_prompt(model) -> None:
    assert refused(model, prompt="") == "prompt must not be empty"


def test_empty_role_is_refused(model) -> None:
    assert refused(model, messages=chat(("user", "a"), ("", "b"))).startswith("messages[1].role")


@pytest.mark.parametrize("num_tokens", [MAX_MODEL_LEN, MAX_MODEL_LEN + 100])
def test_over_long_prompt(model, num_tokens: int) -> None:
    message = refused(model, prompt_token_ids=[5] * num_tokens)
    assert message.startswith("prompt")
    assert f"max_model_len is {MAX_MODEL_LEN}" in message


def test_over_long_text_prompt(model) -> None:
    message = refused(model, prompt="word " * 600)
    assert message.startswith("prompt is")
    assert "max_model_len" in message


def test_longest_prompt_that_fits(model) -> None:
    valid = validate(request(prompt_token_ids=[5] * (MAX_MODEL_LEN - 1)), model)
    assert valid.params.max_tokens == 1


@pytest.mark.parametrize("token_id", [-1, 49152, 2**31 - 1])
def test_token_id_outside_vocab(model, token_id: int) -> None:
    assert model.vocab_size == 49152
    message = refused(model, prompt_token_ids=[1, token_id])
    assert message.startswith("prompt_token_ids:")
    assert str(token_id) in message
    assert "outside the vocabulary" in message


# ---- max_tokens ----


def test_default_max_tokens_fills_the_context(model) -> None:
    ids = [7] * 30
    assert validate(request(prompt_token_ids=ids), model).params.max_tokens == MAX_MODEL_LEN - 30
    valid = validate(request(prompt="Hello world"), model)
    assert valid.params.max_tokens == MAX_MODEL_LEN - len(valid.prompt_token_ids)


def test_max_tokens_that_fits_exactly(model) -> None:
    valid = validate(request(prompt_token_ids=[7] * 12, sampling={"max_tokens": 500}), model)
    assert valid.params.max_tokens == 500


def test_max_tokens_too_large(model) -> None:
    message = refused(model, prompt_token_ids=[7] * 12, sampling={"max_tokens": 501})
    assert message.startswith("sampling.max_tokens:")
    assert "(12 tokens)" in message and "(501)" in message
    assert f"max_model_len ({MAX_MODEL_LEN})" in message


# ---- sampling ----


def test_sampling_fields_reach_the_params(model) -> None:
    sampling = {
        "max_tokens": 9,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 3,
        "min_p": 0.1,
        "seed": 11,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2, 7],
        "ignore_eos": True,
        "logprobs": 2,
        "skip_special_tokens": False,
    }
    params = validate(request(prompt="hi", sampling=sampling), model).params
    assert params == SamplingParams(
        max_tokens=9,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        min_p=0.1,
        seed=11,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 7),
        ignore_eos=True,
        logprobs=2,
        skip_special_tokens=False,
    )


def test_unset_sampling_takes_the_defaults(model) -> None:
    params = validate(request(prompt_token_ids=[3, 4]), model).params
    defaults = SamplingParams()
    assert params == SamplingParams(max_tokens=MAX_MODEL_LEN - 2, seed=None, logprobs=None)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (
        defaults.temperature,
        defaults.top_p,
        defaults.top_k,
        defaults.min_p,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", -1),
        ("logprobs", -1),
        ("logprobs", SamplingParams.MAX_LOGPROBS + 1),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [3, -1]),
    ],
)
def test_sampling_bound_errors_name_the_field(model, field: str, value) -> None:
    message = refused(model, prompt="hi", sampling={field: value})
    assert message.startswith(f"sampling.{field} ")


@pytest.mark.parametrize("token_id", [49152, 10**9])
def test_stop_token_id_outside_vocab(model, token_id: int) -> None:
    message = refused(model, prompt="hi", sampling={"stop_token_ids": [2, token_id]})
    assert message.startswith("sampling.stop_token_ids:")
    assert str(token_id) in message and "outside the vocabulary" in message


def test_last_vocab_id_is_a_valid_stop_token(model) -> None:
    last = model.vocab_size - 1
    params = validate(request(prompt="hi", sampling={"stop_token_ids": [last]}), model).params
    assert params.stop_token_ids == (last,)


# ---- model and ids ----


def test_unknown_model(model) -> None:
    message = refused(model, prompt="hi", model="llama-70b")
    assert message.startswith("model 'llama-70b' is not served here")
    assert "'tiny'" in message


def test_served_model_by_name_or_empty(model) -> None:
    assert validate(request(prompt="hi", model="tiny"), model).prompt_token_ids
    assert validate(request(prompt="hi", model=""), model).prompt_token_ids


@pytest.mark.parametrize(("field", "limit", "prefix"), [
    ("request_id", MAX_REQUEST_ID_CHARS, ""), ("session_id", MAX_ID_CHARS, "public/")])
def test_id_too_long(model, field: str, limit: int, prefix: str) -> None:
    message = refused(model, prompt="hi", **{field: "x" * (limit + 1)})
    assert message.startswith(f"{field} is {limit + 1} characters; the limit is {limit}")
    valid = validate(request(prompt="hi", **{field: "y" * limit}), model)
    assert getattr(valid, field) == prefix + "y" * limit


def test_ids_are_kept_and_sessions_scoped_by_tenant(model) -> None:
    valid = validate(request(prompt="hi", request_id="r-1", session_id="s-1"), model)
    assert (valid.request_id, valid.session_id) == ("r-1", "public/s-1")
    mine = validate(request(prompt="hi", session_id="s-1"), model, tenant="abc")
    assert mine.session_id == "abc/s-1"


def test_empty_request_id_gets_a_unique_one(model) -> None:
    ids = {validate(request(prompt="hi"), model).request_id for _ in range(20)}
    assert len(ids) == 20
    assert all(i and len(i) <= MAX_REQUEST_ID_CHARS for i in ids)
    assert validate(request(prompt="hi"), model).session_id == ""


LIMITS = RequestLimits(max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=3)


@pytest.mark.parametrize(("sampling", "message"), [
    ({"stop": ["a", "b", "c"]}, "sampling.stop: 3 stop strings; the limit is 2"),
    ({"stop": ["a", "toolong"]}, "sampling.stop[1] is 7 characters; the limit is 5"),
    ({"stop_token_ids": [1, 2, 3, 4]}, "sampling.stop_token_ids: 4 ids; the limit is 3"),
])
def test_stop_lists_are_capped(model, sampling, message) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate(request(prompt="hi", sampling=sampling), model, LIMITS)
    assert str(info.value) == message


def test_stop_lists_at_the_caps_pass(model) -> None:
    valid = validate(request(prompt="hi", sampling={"stop": ["a", "12345"],
                                                    "stop_token_ids": [1, 2, 3]}), model, LIMITS)
    assert valid.params.stop == ("a", "12345") and valid.params.stop_token_ids == (1, 2, 3)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_stop_strings"):
        RequestLimits(max_stop_strings=0)


# ---- parse_generate_request: bytes off the wire ----


def test_valid_bytes_parse_to_a_generate_request(model) -> None:
    sent = request(
        request_id="r",
        prompt="héllo ✓",
        session_id="s",
        model="tiny",
        sampling={"stop": ["ß"], "max_tokens": 4},
    )
    got = parse_generate_request(sent.SerializeToString())
    assert isinstance(got, pdserve_pb2.GenerateRequest)
    assert got == sent
    assert validate(got, model).params.stop == ("ß",)


def test_valid_chat_bytes_parse(model) -> None:
    sent = request(messages=chat(("user", "¿qué?")))
    got = parse_generate_request(sent.SerializeToString())
    assert got == sent


def _raw(**kwargs) -> bytes:
    messages = [raw_pb2.RawChatMessage(role=r, content=c) for r, c in kwargs.pop("messages", [])]
    stop = kwargs.pop("stop", None)
    sampling = raw_pb2.RawSamplingParams(stop=stop) if stop is not None else None
    return raw_pb2.RawGenerateRequest(
        messages=messages, sampling=sampling, **kwargs
    ).SerializeToString()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": BAD_UTF8}, "prompt"),
        ({"messages": [(b"user", b"fine"), (b"user", BAD_UTF8)]}, "messages[1].content"),
        ({"messages": [(BAD_UTF8, b"fine")]}, "messages[0].role"),
        ({"prompt": b"hi", "stop": [b"ok", b"\xc3"]}, "sampling.stop[1]"),
        ({"prompt": b"hi", "session_id": BAD_UTF8}, "session_id"),
        ({"prompt": b"hi", "request_id": BAD_UTF8}, "request_id"),
        ({"prompt": b"hi", "model": b"\x80"}, "model"),
    ],
)
def test_invalid_utf8_names_the_field(kwargs, field: str) -> None:
    data = _raw(**kwargs)
    got = parse_generate_request(data)
    assert isinstance(got, InvalidArgument)
    assert str(got).startswith(f"{field} is not valid UTF-8")


def test_invalid_utf8_reports_the_byte_offset() -> None:
    got = parse_generate_request(_raw(prompt=BAD_UTF8))
    assert str(got) == f"prompt is not valid UTF-8 (byte {BAD_UTF8.index(0xFF)})"


def test_garbage_bytes_are_an_invalid_argument() -> None:
    got = parse_generate_request(b"\xff\xff\xff\xff")
    assert isinstance(got, InvalidArgument)
    assert str(got).startswith("request: unreadable message")


def test_raw_twin_is_wire_compatible() -> None:
    """Valid UTF-8 written through the raw twin reads back as the public message."""
    got = parse_generate_request(
        _raw(request_id=b"r", prompt="é".encode(), messages=[(b"user", b"x")], stop=[b"s"])
    )
    assert isinstance(got, pdserve_pb2.GenerateRequest)
    assert (got.request_id, got.prompt, got.messages[0].content, list(got.sampling.stop)) == (
        "r",
        "é",
        "x",
        ["s"],
    )
