"""OpenAI bodies -> router requests, and router messages -> OpenAI JSON (pure, no server)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2
from pdserve.router.openai.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    BadParameter,
    choices,
    parse_chat,
    parse_completion,
)
from pdserve.router.openai.responses import Choices
from pdserve.router.validation import InvalidArgument, ValidRequest


class FakeTexts:
    def __call__(self, token_id: int) -> str:
        return f"<{token_id}>"


def test_completion_fields_map_onto_the_router_request() -> None:
    parsed = parse_completion({
        "model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "top_k": 7, "min_p": 0.1, "seed": 3, "stop": "x", "stop_token_ids": [9],
        "logprobs": 2, "ignore_eos": True, "user": "u", "session_id": "s"})
    (request,) = parsed.requests
    s = request.sampling
    assert request.prompt == "hi" and request.model == "m" and request.session_id == "s"
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (
        5, 0.5, pytest.approx(0.9), 7, pytest.approx(0.1), 3)
    assert list(s.stop) == ["x"] and list(s.stop_token_ids) == [9] and s.ignore_eos
    assert s.logprobs == 2 and parsed.logprobs == 2 and not parsed.chat


def test_completion_defaults_to_sixteen_tokens_chat_to_the_context() -> None:
    assert parse_completion({"prompt": "hi"}).requests[0].sampling.max_tokens == (
        COMPLETION_DEFAULT_MAX_TOKENS)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}).requests[0]
    assert not chat.sampling.HasField("max_tokens")
    assert not chat.sampling.HasField("temperature")


def test_prompt_shapes_and_choices_fan_out() -> None:
    parsed = parse_completion({"prompt": [[1, 2], [3]], "n": 2, "seed": 10})
    assert [list(r.prompt_token_ids) for r in parsed.requests] == [[1, 2], [3]]  # one per prompt
    assert parsed.n == 2 and len({r.request_id for r in parsed.requests}) == 2
    valid = ValidRequest("r", (1, 2), SamplingParams(seed=10), "s")
    fanned = choices(valid, 3)
    assert [c.params.seed for c in fanned] == [10, 11, 12]
    assert [c.request_id for c in fanned] == ["r-0", "r-1", "r-2"]
    assert all(c.prompt_token_ids == (1, 2) and c.session_id == "s" for c in fanned)
    assert [c.params.seed for c in choices(replace(valid, params=SamplingParams()), 2)] == [
        None, None]
    assert [r.prompt for r in parse_completion({"prompt": ["a", "b"]}).requests] == ["a", "b"]
    assert list(parse_completion({"prompt": [5, 6]}).requests[0].prompt_token_ids) == [5, 6]


def test_chat_content_parts_and_logprobs() -> None:
    parsed = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "logprobs": True, "top_logprobs": 4, "max_completion_tokens": 9})
    request = parsed.requests[0]
    assert request.messages[0].content == "ab" and request.sampling.max_tokens == 9
    assert parsed.logprobs == 4 and parsed.max_tokens_param == "max_completion_tokens"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}],
                       "logprobs": True}).logprobs == 0


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "x", "timeout": 0}, "timeout"),
    ({"prompt": "x", "logit_bias": {"a": 2}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1": "2"}}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ({"prompt": "x", "bad_words": ["a", 3]}, "bad_words"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": []}},
     "response_format"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"choice": "b"}}, "structured_outputs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-5]}, "prompt"),
    ({"prompt": ["a"] * 65}, "prompt"),  # MAX_PROMPTS
    ({}, "prompt"),
    ([], "body"),
])
def test_bad_completion_parameters(body, param) -> None:
    with pytest.raises(BadParameter) as err:
        parse_completion(body)
    assert err.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
])
def test_bad_chat_parameters(body, param) -> None:
    with pytest.raises(BadParameter) as err:
        parse_chat(body)
    assert err.value.param == param


def test_router_field_names_become_openai_parameters() -> None:
    def rename(message: str, max_param: str = "max_tokens", prompt: str = "prompt"):
        exc = BadParameter.from_router(InvalidArgument(message), max_param, prompt)
        return exc.param, str(exc)

    assert rename("sampling.top_p must be in (0, 1], got 2")[0] == "top_p"
    assert rename("sampling.max_tokens: prompt (3 tokens) + max_tokens (9) exceeds",
                  "max_completion_tokens") == ("max_completion_tokens",
                                               "max_completion_tokens: prompt (3 tokens) + "
                                               "max_tokens (9) exceeds")
    assert rename("prompt must not be empty", prompt="messages")[0] == "messages"
    assert rename("prompt_token_ids: token id 9 is outside")[0] == "prompt"
    assert rename("messages[0].role must not be empty", prompt="messages")[0] == "messages"
    exc = BadParameter.from_router(InvalidArgument("sampling.structured_outputs.json: bad"),
                                   "max_tokens", "prompt", "response_format")
    assert (exc.param, str(exc)) == ("response_format", "structured_outputs.json: bad")
    assert rename("sampling.stop[3] is 300 characters; the limit is 256") == (
        "stop", "stop[3] is 300 characters; the limit is 256")
    assert rename("sampling.stop_token_ids: 65 ids; the limit is 64")[0] == "stop_token_ids"


def message(text: str, ids: list[int], finish: str = "", stop: str = "",
            **usage) -> pdserve_pb2.GenerateResponse:
    out = pdserve_pb2.GenerateResponse(text=text, token_ids=ids, finish_reason=finish,
                                       stop_reason=stop)
    out.logprobs.extend(pdserve_pb2.TokenLogprob(
        token_id=t, logprob=-0.5, top=[pdserve_pb2.TopLogprob(token_id=t, logprob=-0.5)])
        for t in ids)
    if usage:
        out.usage.CopyFrom(pdserve_pb2.Usage(**usage))
    return out


def test_choices_build_the_same_answer_streamed_and_whole() -> None:
    parsed = parse_completion({"prompt": ["a", "b"], "n": 2, "logprobs": 1, "stop": ["12"]})
    choices = Choices(parsed, "m", FakeTexts())
    chunks = []
    for i in range(4):
        chunks.append(choices.add(i, message("x", [7])))
        chunks.append(choices.add(i, message("y", [8], "stop", prompt_tokens=3 + i,
                                             completion_tokens=2, cached_tokens=i)))
    assert choices.add(0, pdserve_pb2.GenerateResponse()) is None
    whole = choices.response()
    assert [c["text"] for c in whole["choices"]] == ["xy"] * 4
    assert whole["usage"] == {"prompt_tokens": 3 + 5, "completion_tokens": 8,
                              "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 2}}
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 1)
    assert streamed == "xy"
    assert whole["choices"][0]["logprobs"]["tokens"] == ["<7>", "<8>"]
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 1]  # into the text
    assert choices.usage_chunk()["choices"] == []


def test_stop_reason_is_a_string_or_a_token_id() -> None:
    parsed = parse_completion({"prompt": "a", "stop": ["12"]})
    choices = Choices(parsed, "m", FakeTexts())
    choices.add(0, message("", [], "stop", prompt_tokens=1, stop="12"))
    assert choices.response()["choices"][0]["stop_reason"] == "12"
    choices = Choices(parse_completion({"prompt": "a", "stop_token_ids": [7]}), "m", FakeTexts())
    choices.add(0, message("", [], "stop", prompt_tokens=1, stop="7"))
    assert choices.response()["choices"][0]["stop_reason"] == 7
    choices = Choices(parse_completion({"prompt": "a"}), "m", FakeTexts())
    choices.add(0, message("", [], "stop", prompt_tokens=1, stop="2"))  # EOS
    assert choices.response()["choices"][0]["stop_reason"] is None


def test_chat_chunks_open_with_the_role() -> None:
    parsed = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 2})
    choices = Choices(parsed, "m", FakeTexts())
    first = choices.first_chunks()
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    chunk = choices.add(1, message("hi", [3]))
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0] == {"index": 1, "finish_reason": None,
                                   "delta": {"content": "hi"}, "logprobs": None}
    done = choices.add(1, message("", [], "length", prompt_tokens=2, completion_tokens=1))
    assert done["choices"][0]["delta"] == {} and done["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body", [
    {"prompt": ["a", "b"], "n": 2},
    {"messages": [{"role": "user", "content": "x"}], "n": 3},
    {"prompt": "a", "logprobs": 1},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1},
])
def test_streamed_chunk_json_is_the_chunk_dumped(body) -> None:
    """add_json (a template for plain deltas) writes exactly what json.dumps of add's chunk
    does, for every choice, any text (quotes, escapes, control characters, non-ASCII, the
    template's own mark), and the last message; and both keep the same answer."""
    import json
    import random

    parsed = (parse_chat if "messages" in body else parse_completion)(body)
    fast, slow = (Choices(parsed, 'model "m"\x00', FakeTexts()) for _ in range(2))
    slow.created = fast.created
    rng = random.Random(0)
    alphabet = ['a', ' ', '"', '\\', '\n', '\x00', '\x1f', 'é', '漢', '😀', '</', '{"x":1}']
    for step in range(30):
        for i in range(len(fast.choices)):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(4)))
            ids = [rng.randrange(100) for _ in range(rng.randrange(3))]
            last = step == 29
            msg = message(text, ids, "length" if last else "", prompt_tokens=3 if last else 0)
            chunk = slow.add(i, msg)
            assert fast.add_json(i, msg) == (None if chunk is None else
                                             json.dumps(chunk, separators=(",", ":")))
    assert fast.response() == slow.response()
