"""Structured outputs, penalties and logit_bias over the served PD path (real Ray workers,
router, both fronts), on a tiny random Llama that never writes valid JSON on its own: every
constrained answer must parse and validate anyway, sampled at temperature 0.8."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest

from pdserve import SamplingParams, StructuredOutputsParams
from pdserve.client import Client
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.harness import stats, wait_until

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                  "maxItems": 3}},
     "required": ["color", "sizes"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "y": {"type": "integer", "minimum": -5, "maximum": 5}},
            "required": ["x", "y"], "additionalProperties": False},
        "ok": {"type": "boolean"}},
     "required": ["point", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "level": {"enum": [1, 2, 3]}},
     "required": ["tags", "level"], "additionalProperties": False},
]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def service(tiny_service):
    return tiny_service


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.http_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def http_answer(client, model: str, schema: dict, seed: int, stream: bool) -> str:
    kwargs = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed,
              "messages": [{"role": "user", "content": "Answer in JSON."}],
              "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "answer", "schema": schema}}}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop", choice
        return choice.message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def grpc_answer(address: str, schema: dict, seed: int) -> str:
    sampling = pdserve_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=seed,
        structured_outputs=pdserve_pb2.StructuredOutputs(json=json.dumps(schema)))
    request = pdserve_pb2.GenerateRequest(prompt="Answer in JSON:", sampling=sampling)
    with grpc.insecure_channel(address) as channel:
        messages = list(pdserve_pb2_grpc.InferenceStub(channel).Generate(request, timeout=120))
    assert messages[-1].finish_reason == "stop"
    return "".join(m.text for m in messages)


def test_json_schema_answers_parse_and_validate_on_every_path(service, client, model):
    """50 requests, ten per schema, whole and streamed over HTTP and over gRPC, at once."""
    jobs = []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        path = ("whole", "stream", "grpc")[i % 3]
        jobs.append((schema, path, i))

    def run(job):
        schema, path, seed = job
        if path == "grpc":
            return grpc_answer(service.address, schema, seed)
        return http_answer(client, model, schema, seed, path == "stream")

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(run, jobs))
    for (schema, _, _), text in zip(jobs, answers):
        jsonschema.validate(json.loads(text), schema)  # raises, naming the path in the value
    assert len(set(answers)) > len(SCHEMAS)  # sampled, not one answer per schema
    wait_until(lambda: all(w.num_used_blocks == 0 for w in stats(service.address).workers),
               30, "every block freed")


def test_regex_choice_and_grammar(client, model):
    def complete(spec: dict) -> str:
        return client.completions.create(model=model, prompt="x", max_tokens=40,
                                         temperature=0.8, seed=3,
                                         extra_body={"structured_outputs": spec}).choices[0].text

    assert complete({"choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    phone = complete({"regex": r"\d{3}-\d{4}"})
    assert len(phone) == 8 and phone[3] == "-" and (phone[:3] + phone[4:]).isdigit()
    assert complete({"grammar": 'root ::= "a" ("b" | "c")'}) in ("ab", "ac")


def test_logit_bias_and_penalties_change_real_outputs(client, model):
    def tokens(**extra) -> list[str]:
        got = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=24,
                                        temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, **extra})
        return got.choices[0].logprobs.tokens

    plain = tokens()
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself greedily
    assert len(set(tokens(presence_penalty=2.0, frequency_penalty=2.0))) > len(set(plain))
    forced = tokens(logit_bias={"42": 100})
    assert set(forced) == {forced[0]} and forced != plain
    banned = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=24,
                                       temperature=0, extra_body={"ignore_eos": True,
                                                                  "bad_words": [plain[0]]})
    assert not banned.choices[0].text.startswith(plain[0])


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
])
def test_bad_controls_are_a_400_naming_the_field(service, model, body, param):
    def idle() -> bool:
        return all(w.num_running == w.num_waiting == 0 for w in stats(service.address).workers)

    wait_until(idle, 30, "the workers idle")
    got = httpx.post(f"{service.http_url}/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "x"}], **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param, got.json()
    assert idle()  # refused by the router: no worker took it


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"C"}}\n</tool_call>')


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], str, str | None]:
    """(name, arguments) per call index, the content and the finish reason of a stream, as
    the official client's deltas carry them."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += (call.function.name or "") if call.function else ""
                entry[1] += (call.function.arguments or "") if call.function else ""
    return [tuple(calls[i]) for i in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_tool_choice_gives_valid_arguments(client, model, choice):
    kwargs = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 11,
              "messages": [{"role": "user", "content": "What now?"}],
              "tools": [WEATHER, TIME], "tool_choice": choice}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    stream, content, finish = streamed_calls(client.chat.completions.create(stream=True,
                                                                            **kwargs))
    assert finish == "tool_calls" and not content
    for name, arguments in calls + stream:
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])
    assert [name for name, _ in calls] == [name for name, _ in stream]
    if isinstance(choice, dict):
        assert {name for name, _ in calls} == {"get_time"}


def test_auto_tool_calls_are_parsed_whole_streamed_and_over_grpc(service, client, model):
    """The model is made to write a Hermes call (a choice grammar): the reply is read back."""
    kwargs = {"model": model, "max_tokens": 60, "temperature": 0,
              "messages": [{"role": "user", "content": "Weather in Paris?"}],
              "tools": [WEATHER], "extra_body": {"structured_outputs": {"choice": [HERMES_CALL]}}}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [call] = whole.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    stream, content, finish = streamed_calls(client.chat.completions.create(stream=True,
                                                                            **kwargs))
    assert (stream, content, finish) == ([("get_weather", call.function.arguments)], "",
                                         "tool_calls")
    with Client(service.address, timeout=60) as grpc_client:  # the gRPC API's own messages
        got = grpc_client.complete(
            messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
            sampling=SamplingParams(max_tokens=60, temperature=0, structured_outputs=(
                StructuredOutputsParams(choice=[HERMES_CALL]))))
    assert got.finish_reason == "tool_calls" and got.content is None
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]
    # the next turn: the call and its result render through the chat template
    follow = client.chat.completions.create(model=model, max_tokens=4, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}], tools=[WEATHER])
    assert follow.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(service, model, body, param):
    got = httpx.post(f"{service.http_url}/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "x"}], **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param, got.json()


THOUGHT, ANSWER = "Paris is in France.", "Sunny."


def test_reasoning_is_split_from_the_answer_whole_streamed_and_over_grpc(service, client, model):
    """The shared service splits reasoning as Qwen3's (--reasoning-parser qwen3); the model is
    made to open with a <think> block (a choice grammar): the block is reasoning_content, the
    rest the answer, tool calls are read from the answer, and enable_thinking false (the chat
    template's switch) leaves the reply whole."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = f"<think>{THOUGHT}</think>{ANSWER}"
    kwargs = {"model": model, "max_tokens": 120, "temperature": 0, "messages": messages,
              "extra_body": {"structured_outputs": {"choice": [reply]}}}
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)
    chunks = list(client.chat.completions.create(stream=True, stream_options={
        "include_usage": True}, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # all tokens
    off = client.chat.completions.create(**{**kwargs, "extra_body": {
        **kwargs["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}})
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (
        None, reply)
    tool_reply = f"<think>{THOUGHT}</think>{HERMES_CALL}"
    called = client.chat.completions.create(**{**kwargs, "tools": [WEATHER], "extra_body": {
        "structured_outputs": {"choice": [tool_reply]}}}).choices[0]
    assert called.finish_reason == "tool_calls" and called.message.reasoning_content == THOUGHT
    assert [c.function.name for c in called.message.tool_calls] == ["get_weather"]
    with Client(service.address, timeout=60) as grpc_client:  # the gRPC API's last message
        got = grpc_client.complete(messages=messages, sampling=SamplingParams(
            max_tokens=120, temperature=0,
            structured_outputs=StructuredOutputsParams(choice=[reply])))
    assert (got.text, got.reasoning_content, got.content) == (reply, THOUGHT, ANSWER)
