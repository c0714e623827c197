"""Reasoning split from the answer (--reasoning-parser): the scanner whole and streamed (a
stream cut anywhere reassembles to the whole parse), the per-request switches, and the
OpenAI answer built from it, with tool calls read from the answer alone."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from pdserve.proto import pdserve_pb2, raw_pb2
from pdserve.router.openai.protocol import parse_chat
from pdserve.router.openai.responses import Choices, TokenTexts
from pdserve.router.reasoning import (
    CONTENT,
    REASONING_PARSERS,
    START_CONTENT,
    START_REASONING,
    ReasoningStream,
    first_mode,
    split,
)
from pdserve.router.tools import read_reply
from pdserve.router.validation import (
    InvalidArgument,
    ModelContext,
    parse_generate_request,
    validate,
)

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'

# (mode, reply, reasoning, content)
EXAMPLES = [
    (R1, "<think>\nAdd them.\n</think>\n\nIt is 4.", "\nAdd them.\n", "\n\nIt is 4."),
    (R1, "Add them.</think>It is 4.", "Add them.", "It is 4."),  # <think> was the prompt's
    (R1, "Add them, and then", "Add them, and then", ""),  # cut before </think>: all reasoning
    (R1, "<think>Add them", "Add them", ""),
    (R1, "</think>It is 4.", None, "It is 4."),  # an empty block is no reasoning
    (R1, "<think></think>", None, ""),
    (R1, "  \n<think>a</think>b</think>c", "a", "b</think>c"),  # blanks before the tag go
    (R1, "a <think> b</think>c", "a <think> b", "c"),  # a later <think> is text
    (R1, "<thi", "<thi", ""),  # no tag after all
    (R1, "", None, ""),
    (QWEN3, "<think>\nAdd them.\n</think>\n\nIt is 4.", "\nAdd them.\n", "\n\nIt is 4."),
    (QWEN3, "It is 4.", None, "It is 4."),  # no start tag: all content
    (QWEN3, "It is 4.</think> really", None, "It is 4.</think> really"),
    (QWEN3, "So <think>x</think>y", None, "So <think>x</think>y"),
    (QWEN3, "<think>Add them", "Add them", ""),  # cut by max_tokens: all reasoning
    (QWEN3, "<think></think>It is 4.", None, "It is 4."),
    (QWEN3, "\n\n", None, "\n\n"),
    (QWEN3, "<", None, "<"),
    (QWEN3, "<think>a</think>" + CALL, "a", CALL),
]


def stream(mode: str, pieces: list[str]) -> list[tuple[str, str]]:
    reader = ReasoningStream(mode)
    out = [reader.feed(p) for p in pieces] + [reader.finish()]
    return [piece for piece in out if piece != ("", "")]


def reassemble(pieces: list[tuple[str, str]]) -> tuple[str | None, str]:
    reasoning = "".join(r for r, _ in pieces)
    return reasoning or None, "".join(c for _, c in pieces)


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))
                  if len(text) > 1 else [])
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


@pytest.mark.parametrize(("mode", "text", "reasoning", "content"), EXAMPLES)
def test_whole_replies_split_as_vllm_reads_them(mode, text, reasoning, content) -> None:
    assert split(text, mode) == (reasoning, content)


@pytest.mark.parametrize(("mode", "text", "reasoning", "content"), EXAMPLES)
def test_any_stream_reassembles_to_the_whole_parse(mode, text, reasoning, content) -> None:
    rng = random.Random(text)
    for pieces in [[text], list(text), *(splits(text, rng) for _ in range(150))]:
        assert reassemble(stream(mode, pieces)) == (reasoning, content), pieces


def test_a_tag_cut_in_two_is_held_back_until_known() -> None:
    reader = ReasoningStream(R1)
    assert reader.feed("<th") == ("", "") and reader.feed("ink>Add") == ("Add", "")
    assert reader.feed(" them</thi") == (" them", "")
    assert not reader.answering
    assert reader.feed("nk>It") == ("", "It") and reader.answering
    assert reader.feed(" is 4.") == ("", " is 4.")
    qwen = ReasoningStream(QWEN3)
    assert qwen.feed(" \n") == ("", "") and qwen.feed("<thinking") == ("", " \n<thinking")
    assert qwen.mode == CONTENT and qwen.answering
    prose = ReasoningStream(R1)
    assert prose.feed("x </th") == ("x ", "") and prose.feed("en") == ("</then", "")
    assert prose.finish() == ("", "")


def test_first_mode_per_parser_and_request() -> None:
    assert first_mode(None) is None
    assert first_mode("deepseek_r1") == START_REASONING
    assert first_mode("qwen3") == START_CONTENT
    assert first_mode("deepseek_r1", thinking=False) is None  # enable_thinking false
    assert first_mode("qwen3", thinking=False) is None
    # a reply a grammar shapes from its first token reasons only where it opens <think>
    assert first_mode("deepseek_r1", constrained=True) == START_CONTENT
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        first_mode("deepseek-r1")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ModelContext("m", None, 10, 10, reasoning_parser="r1")


# ---------------------------------------------------------------- the request's switches

TEMPLATE = ("{% for m in messages %}{{ m.content }}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}[no thinking]"
            "{% else %}[thinking]{% endif %}")


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> ModelContext:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.chat_template = TEMPLATE
    return ModelContext("tiny", tokenizer, len(tokenizer), 256, reasoning_parser="qwen3")


def chat_request(**kwargs: Any) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        messages=[pdserve_pb2.ChatMessage(role="user", content="2 + 2?")], **kwargs)


def test_chat_template_kwargs_reach_the_template_and_switch_thinking(model) -> None:
    tokenizer = model.tokenizer
    on = validate(chat_request(), model)
    off = validate(chat_request(chat_template_kwargs='{"enable_thinking": false}'), model)
    assert tokenizer.decode(on.prompt_token_ids).endswith("[thinking]")
    assert tokenizer.decode(off.prompt_token_ids).endswith("[no thinking]")
    assert (on.reasoning_mode, off.reasoning_mode) == (START_CONTENT, None)
    assert validate(pdserve_pb2.GenerateRequest(prompt="2 + 2?"), model).reasoning_mode is None
    plain = dataclasses.replace(model, reasoning_parser=None)
    assert validate(chat_request(), plain).reasoning_mode is None  # no flag: no split


@pytest.mark.parametrize(("kwargs", "message"), [
    ("[1]", "chat_template_kwargs must be a JSON object"),
    ("{", "chat_template_kwargs is not JSON"),
    ('{"enable_thinking": "no"}', "chat_template_kwargs.enable_thinking must be a boolean"),
    ('{"tokenize": true, "chat_template": "x"}',
     "chat_template_kwargs: chat_template, tokenize set by the server"),
])
def test_bad_chat_template_kwargs_are_refused_naming_them(model, kwargs, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        validate(chat_request(chat_template_kwargs=kwargs), model)
    with pytest.raises(InvalidArgument, match="chat_template_kwargs: needs messages"):
        validate(pdserve_pb2.GenerateRequest(prompt="x", chat_template_kwargs="{}"), model)


def test_kwargs_that_are_not_utf8_are_named() -> None:
    data = raw_pb2.RawGenerateRequest(prompt=b"x", chat_template_kwargs=b'{"a": "\xff"}')
    refusal = parse_generate_request(data.SerializeToString())
    assert str(refusal).startswith("chat_template_kwargs is not valid UTF-8")


# ---------------------------------------------------------------- the OpenAI answer

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}}}}


def router_messages(body: dict[str, Any], mode: str | None, text: str,
                    rng: random.Random, tool_parser: str = "hermes"
                    ) -> list[pdserve_pb2.GenerateResponse]:
    """What the router streams for `text`: its pieces, then a last message with the router's
    reading of the whole reply (as router/stream.py makes it)."""
    pieces = splits(text, rng)
    messages = [pdserve_pb2.GenerateResponse(text=p, token_ids=[7]) for p in pieces]
    last = messages[-1]
    last.finish_reason, content = "stop", text
    if mode is not None:
        reasoning, content = split(text, mode)
        last.reasoning_content, last.content = reasoning or "", content
    tools = parse_chat(body).tools
    if tools is not None:
        content, calls = read_reply(tools, tool_parser, content)
        last.content = content or ""
        last.tool_calls.extend(pdserve_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                               for c in calls)
        last.finish_reason = "tool_calls" if calls else "stop"
    return messages


def answers(body: dict[str, Any], parser: str | None, text: str, seed: int = 0,
            tool_parser: str = "hermes") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole answer and the streamed chunks' choices for `text` as the model's reply."""
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
    tools = parse_chat(body).tools
    mode = first_mode(parser, thinking, calls=tool_parser == "openai" and tools is not None
                      and tools.choice == "auto")
    out = []
    for stream_it in (False, True):
        request = parse_chat({**body, "stream": stream_it})
        choices = Choices(request, "m", TokenTexts(None), tool_parser, None, parser, [mode])
        chunks = []
        for message in router_messages(body, mode, text, random.Random(seed), tool_parser):
            if choices.reads(0):
                chunks += choices.read_chunks(0, message)
            elif (chunk := choices.add_json(0, message)) is not None:  # plain text
                chunks.append(json.loads(chunk))
        out.append(choices.response()["choices"][0] if not stream_it
                   else [c["choices"][0] for c in chunks])
    return out[0], out[1]


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A client's reading of the streamed deltas."""
    got: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": []}
    for chunk in chunks:
        delta = chunk["delta"]
        assert set(delta) <= {"reasoning_content", "content", "tool_calls"}
        for key in ("reasoning_content", "content"):
            got[key] += delta.get(key, "")
        got["calls"] += [(c["function"].get("name"), c["function"]["arguments"])
                         for c in delta.get("tool_calls", [])]
        got["finish_reason"] = chunk["finish_reason"]
    return got


BODY = {"messages": [{"role": "user", "content": "2 + 2?"}]}
REPLY = "<think>\nTwo and two.\n</think>\n\nIt is 4."


@pytest.mark.parametrize("seed", range(20))
def test_whole_and_streamed_answers_carry_the_same_split(seed) -> None:
    whole, chunks = answers(BODY, "qwen3", REPLY, seed)
    assert whole["message"] == {"role": "assistant", "reasoning_content": "\nTwo and two.\n",
                                "content": "\n\nIt is 4."}
    got = accumulate(chunks)
    assert (got["reasoning_content"], got["content"]) == ("\nTwo and two.\n", "\n\nIt is 4.")
    assert "<think>" not in json.dumps(chunks) and "</think>" not in json.dumps(chunks)


def test_reply_without_reasoning_and_the_switches() -> None:
    whole, _ = answers(BODY, "qwen3", "It is 4.")
    assert whole["message"] == {"role": "assistant", "reasoning_content": None,
                                "content": "It is 4."}
    whole, chunks = answers(BODY, "deepseek_r1", "Two and two")  # never closed: all reasoning
    assert whole["message"]["content"] is None
    assert accumulate(chunks)["reasoning_content"] == "Two and two"
    off = {**BODY, "chat_template_kwargs": {"enable_thinking": False}}
    whole, chunks = answers(off, "qwen3", REPLY)
    assert whole["message"] == {"role": "assistant", "reasoning_content": None, "content": REPLY}
    assert accumulate(chunks)["content"] == REPLY
    hidden = {**BODY, "include_reasoning": False}
    whole, chunks = answers(hidden, "qwen3", REPLY)
    assert whole["message"] == {"role": "assistant", "content": "\n\nIt is 4."}
    assert accumulate(chunks)["reasoning_content"] == ""
    whole, chunks = answers(BODY, None, REPLY)  # no --reasoning-parser: as before
    assert whole["message"] == {"role": "assistant", "content": REPLY}
    assert "reasoning_content" not in json.dumps(chunks)


@pytest.mark.parametrize("seed", range(10))
def test_tool_calls_are_read_from_the_answer_only(seed) -> None:
    body = {**BODY, "tools": [TIME]}
    inner = CALL.replace('"zone": 2', '"zone": 9')  # a call the model only thought about
    whole, chunks = answers(body, "qwen3", f"<think>maybe {inner}</think>{CALL}", seed)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"] == f"maybe {inner}"
    assert whole["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["message"]["tool_calls"]] == [("get_time", {"zone": 2})]
    got = accumulate(chunks)
    assert got["reasoning_content"] == f"maybe {inner}" and got["content"] == ""
    assert [(n, json.loads(a) if a else a) for n, a in got["calls"]] == [
        ("get_time", ""), (None, {"zone": 2})]
    assert got["finish_reason"] == "tool_calls"
