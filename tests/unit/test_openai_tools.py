"""OpenAI tool calling: request checks, the forced grammar, and the reply parsers, whole and
streamed (a stream must reassemble to the whole parse however the text is split)."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall

from pdserve.router.openai.errors import BadParameter
from pdserve.router.tools import (
    NO_PARAMETERS,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolStream,
    ToolCall,
    ToolParser,
    finish_reason,
    forced_calls,
    forced_schema,
    forced_stream,
    new_call_id,
    parse_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
UNIT_REF = {"type": "function", "function": {
    "name": "convert", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Unit"}}, "required": ["to"],
        "$defs": {"Unit": {"type": "string", "enum": ["C", "F"]}}}}}


def counter() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def tools(**body: Any) -> Any:
    return parse_tools({"tools": [WEATHER, TIME], **body})


# ---------------------------------------------------------------- parse_tools


def test_no_tools_is_none_and_defaults_follow_openai() -> None:
    assert parse_tools({}) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    assert parse_tools({"tools": None, "parallel_tool_calls": False}) is None
    req = tools()
    assert (req.choice, req.function, req.parallel_tool_calls) == ("auto", None, True)
    assert req.tools == (WEATHER, TIME)  # as sent, for the chat template
    assert req.schemas["get_weather"] == WEATHER["function"]["parameters"]
    assert req.schemas["get_time"] == NO_PARAMETERS
    named = tools(tool_choice={"type": "function", "function": {"name": "get_time"}},
                  parallel_tool_calls=False)
    assert (named.choice, named.function, named.parallel_tool_calls) == (
        "function", "get_time", False)
    assert tools(tool_choice="none").choice == "none"
    assert tools(tool_choice="required").choice == "required"


def function(**fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **fields}}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tool_choice": "auto"}, "tool_choice", "without tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "without tools"),
    ({"tools": {"a": 1}}, "tools", "tools: must be a list"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": ["get_weather"]}, "tools", "tools[0]: must be"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools", "tools[0]: must be"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function: must be an object"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "get weather"}}]},
     "tools", "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
     "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0].function.name"),
    ({"tools": [function(description=3)]}, "tools", "tools[0].function.description"),
    ({"tools": [function(strict="yes")]}, "tools", "tools[0].function.strict"),
    ({"tools": [function(parameters="object")]}, "tools", "tools[0].function.parameters"),
    ({"tools": [function(parameters={"type": "objekt"})]},
     "tools", "tools[0].function.parameters['type']: not a valid JSON Schema"),
    ({"tools": [function(parameters={"type": "object", "required": "city"})]},
     "tools", "not a valid JSON Schema"),
    ({"tools": [function(parameters=json.loads('{"items": ' * 300 + "{}" + "}" * 300))]},
     "tools", "tools[0].function.parameters: nested too deeply"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "tools[1].function.name: 'get_weather' is "
                                             "declared twice"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}},
     "tool_choice", "must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not among tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "true"}, "parallel_tool_calls", "boolean"),
])
def test_bad_tools_are_400s_naming_the_parameter(body: dict[str, Any], param: str,
                                                 message: str) -> None:
    with pytest.raises(BadParameter) as info:
        parse_tools(body)
    assert info.value.param == param
    assert message in str(info.value)


def test_conflicting_defs_are_refused_only_where_a_grammar_combines_them() -> None:
    other = json.loads(json.dumps(UNIT_REF))
    other["function"]["name"] = "convert_back"
    other["function"]["parameters"]["$defs"]["Unit"]["enum"] = ["K"]
    assert parse_tools({"tools": [UNIT_REF, other]}).choice == "auto"
    with pytest.raises(BadParameter, match=r"\$defs 'Unit'") as info:
        parse_tools({"tools": [UNIT_REF, other], "tool_choice": "required"})
    assert info.value.param == "tools"


# ---------------------------------------------------------------- forced choices


def accepts(schema_text: str, instance: Any) -> bool:
    schema = json.loads(schema_text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_free_choices_have_no_grammar() -> None:
    assert forced_schema(tools()) is None
    assert forced_schema(tools(tool_choice="none")) is None


def test_a_named_function_constrains_the_reply_to_its_arguments() -> None:
    schema = forced_schema(tools(tool_choice={"type": "function",
                                              "function": {"name": "get_weather"}}))
    assert json.loads(schema) == WEATHER["function"]["parameters"]
    assert accepts(schema, {"city": "Paris", "unit": "celsius"})
    assert not accepts(schema, {"unit": "celsius"})
    assert not accepts(schema, {"city": "Paris", "unit": "kelvin"})
    no_parameters = forced_schema(tools(tool_choice={"type": "function",
                                                     "function": {"name": "get_time"}}))
    assert accepts(no_parameters, {}) and not accepts(no_parameters, [])


def test_required_constrains_the_reply_to_a_list_of_declared_calls() -> None:
    schema = forced_schema(tools(tool_choice="required"))
    paris = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert accepts(schema, [paris])
    assert accepts(schema, [paris, {"name": "get_time", "parameters": {}}])
    assert not accepts(schema, [])  # at least one call
    assert not accepts(schema, [{"name": "get_news", "parameters": {}}])
    assert not accepts(schema, [{"name": "get_weather", "parameters": {"unit": "celsius"}}])
    assert not accepts(schema, [{"name": "get_weather"}])
    assert not accepts(schema, [{**paris, "id": "x"}])
    assert not accepts(schema, paris)
    one = forced_schema(tools(tool_choice="required", parallel_tool_calls=False))
    assert accepts(one, [paris]) and not accepts(one, [paris, paris])


def test_required_moves_defs_to_the_root_where_refs_resolve() -> None:
    req = parse_tools({"tools": [UNIT_REF, WEATHER], "tool_choice": "required"})
    schema = forced_schema(req)
    assert json.loads(schema)["$defs"] == {"Unit": {"type": "string", "enum": ["C", "F"]}}
    assert accepts(schema, [{"name": "convert", "parameters": {"to": "F"}}])
    assert not accepts(schema, [{"name": "convert", "parameters": {"to": "K"}}])
    assert "$defs" in UNIT_REF["function"]["parameters"]  # the request is left as sent


def test_forced_calls_read_the_constrained_reply() -> None:
    named = tools(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced_calls(named, '{"city": "Paris"}', counter()) == [
        ToolCall("call_0", "get_weather", '{"city": "Paris"}')]
    required = tools(tool_choice="required")
    reply = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
             '{"name": "get_time", "parameters": {}}]')
    assert forced_calls(required, reply, counter()) == [
        ToolCall("call_0", "get_weather", '{"city": "Zürich"}'),
        ToolCall("call_1", "get_time", "{}")]
    cut = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci'
    assert [c.name for c in forced_calls(required, cut)] == ["get_time"]
    with pytest.raises(ValueError, match="forces no call"):
        forced_calls(tools(), "{}")


# ---------------------------------------------------------------- parsers, whole


HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     "\n</tool_call>",
     None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("Let me check both.\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check both.\n", [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")]),
    # Hermes 2 Pro writes the arguments first; Qwen may stop before the closing tag
    ('<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time"}\n',
     None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', []),
    ('<tool_call>\n{"name": "get_weather", "argum',
     '<tool_call>\n{"name": "get_weather", "argum', []),
    ('<tool_call>\n{"name": 1, "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": 1, "arguments": {}}\n</tool_call>\n', [("get_time", "{}")]),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone, <tool_>s.',
     "\nDone, <tool_>s.", [("get_time", "{}")]),
    ("Use <b>bold</b> and a < b; write <tool_call> tags yourself.",
     "Use <b>bold</b> and a < b; write <tool_call> tags yourself.", []),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("\n\n", "\n\n", []),
    ("", None, []),
]

LLAMA3 = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None, [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ('\n{"name": "get_weather", "arguments": {"city": "Zürich"}}; '
     '{"name": "get_time", "parameters": {}}\n',
     None, [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")]),
    ('{"name": "get_time", "parameters": {}}; I asked for the time.',
     "I asked for the time.", [("get_time", "{}")]),
    ('{"name": "get_weather", "parameters": {"city": ',
     '{"name": "get_weather", "parameters": {"city": ', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('<|python_tag|>brave_search.call(query="weather")',
     '<|python_tag|>brave_search.call(query="weather")', []),
    ("It is sunny in Paris {today}.", "It is sunny in Paris {today}.", []),
    ("<|pyth", "<|pyth", []),
    ("", None, []),
]

EXAMPLES = [(HermesToolParser, *e) for e in HERMES] + [(Llama3JsonToolParser, *e) for e in LLAMA3]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), EXAMPLES)
def test_parsers_split_realistic_replies(parser: type[ToolParser], text: str,
                                         content: str | None,
                                         calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parser.parse(text, new_id=counter())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_{i}" for i in range(len(calls))]
    for call in got_calls:  # what the official client reads
        parsed = ChatCompletionMessageToolCall.model_validate(call.to_openai())
        assert (parsed.id, parsed.function.name, parsed.function.arguments) == (
            call.id, call.name, call.arguments)
        json.loads(call.arguments)


def test_parsers_are_picked_by_vllms_names_and_ids_look_like_openais() -> None:
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    text = HERMES[1][0]
    content, calls = HermesToolParser.parse(text, parallel_tool_calls=False)
    assert content == "Let me check both.\n" and [c.name for c in calls] == ["get_weather"]
    assert reassemble(stream(HermesToolParser(False, counter()), [text]))[1] == [
        ("call_0", "get_weather", '{"city": "Zürich"}')]


def test_finish_reason_says_tool_calls_unless_the_reply_was_cut() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason("length", True) == "length"


# ---------------------------------------------------------------- parsers, streamed


def stream(parser: Any, pieces: list[str]) -> list[dict[str, Any]]:
    deltas = [d for piece in pieces for d in parser.feed(piece)]
    return deltas + parser.finish()


def reassemble(deltas: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """What a client makes of the deltas, each checked against the official client's types."""
    content, calls = "", {}
    for delta in deltas:
        ChoiceDelta.model_validate(delta)
        assert set(delta) in ({"content"}, {"tool_calls"})
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            parsed = ChoiceDeltaToolCall.model_validate(call)
            if parsed.index not in calls:
                assert parsed.id and parsed.type == "function" and parsed.function.name
                assert parsed.index == len(calls)  # indices come in order
                calls[parsed.index] = [parsed.id, parsed.function.name, ""]
            else:
                assert parsed.id is None and parsed.function.name is None
            calls[parsed.index][2] += parsed.function.arguments
    return content or None, [tuple(c) for c in calls.values()]


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))
                  if len(text) > 1 else [])
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), EXAMPLES)
def test_any_stream_reassembles_to_the_whole_parse(parser: type[ToolParser], text: str,
                                                   content: str | None,
                                                   calls: list[tuple[str, str]]) -> None:
    whole_content, whole_calls = parser.parse(text, new_id=counter())
    whole = (whole_content, [(c.id, c.name, c.arguments) for c in whole_calls])
    rng = random.Random(text)
    chunkings = [[text], list(text), *(splits(text, rng) for _ in range(150))]
    for pieces in chunkings:
        assert reassemble(stream(parser(new_id=counter()), pieces)) == whole, pieces


def test_the_official_client_accumulates_the_stream_into_the_whole_parse() -> None:
    text = HERMES[1][0]
    state = ChatCompletionStreamState()
    deltas = [{"role": "assistant"}, *stream(HermesToolParser(), splits(text, random.Random(1)))]
    for i, delta in enumerate([*deltas, {}]):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta,
                         "finish_reason": "tool_calls" if i == len(deltas) else None}]}))
    message = state.get_final_completion().choices[0].message
    content, calls = HermesToolParser.parse(text)
    assert message.content == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.name, c.arguments) for c in calls]


def test_text_that_may_start_a_call_is_held_back() -> None:
    parser = HermesToolParser(new_id=counter())
    assert parser.feed("Sure <tool_") == [{"content": "Sure "}]
    assert parser.feed("call>\n{") == []
    assert parser.feed('"name": "get_time", "arguments": {}}\n</tool_call>') == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    assert parser.finish() == [] and parser.num_calls == 1
    prose = HermesToolParser()
    assert prose.feed("a <tool_") == [{"content": "a "}]
    assert prose.feed("s> b") == [{"content": "<tool_s> b"}]
    llama = Llama3JsonToolParser()
    assert llama.feed("<|python") == [] and llama.feed("_tag|>{") == []
    assert llama.finish() == [{"content": "<|python_tag|>{"}]


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"])
def test_forced_streams_reassemble_to_forced_calls(choice: Any) -> None:
    req = tools(tool_choice=choice)
    text = ('{"city": "Paris", "unit": "celsius"}' if req.function else
            '[{"name": "get_weather", "parameters": {"city": "Paris"}},\n'
            ' {"name": "get_time", "parameters": {}}]')
    whole = (None, [(c.id, c.name, c.arguments) for c in forced_calls(req, text, counter())])
    rng = random.Random(0)
    for pieces in [[text], list(text), *(splits(text, rng) for _ in range(100))]:
        assert reassemble(stream(forced_stream(req, counter()), pieces)) == whole
    assert isinstance(forced_stream(req), NamedToolStream) == (req.function is not None)
