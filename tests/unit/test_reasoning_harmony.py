"""gpt-oss's harmony replies split by `--reasoning-parser openai_gptoss`: the scanner whole and
streamed (markers one token each, text cut anywhere), the request's switches, and the router
detokenizing such a reply with its special tokens kept (a real tokenizer with harmony's markers
added), through to the OpenAI answer."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any

import pytest
from transformers import AutoTokenizer

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2
from pdserve.router.invalid_argument import BadParameter
from pdserve.router.openai.protocol import parse_chat
from pdserve.router.openai.responses import Choices, TokenTexts
from pdserve.router.reasoning import REASONING_PARSERS, first_mode, split
from pdserve.router.tools import OpenAIToolParser
from pdserve.router.validation import InvalidArgument, ModelContext, ValidRequest, validate
from tests.unit.test_reasoning import (
    BODY,
    TIME,
    accumulate,
    answers,
    reassemble,
    splits,
    stream,
)
from tests.unit.test_response_stream import delta, run_stream

HARMONY = REASONING_PARSERS["openai_gptoss"]
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"
NEXT = "<|end|><|start|>assistant"  # a message ends, the next one's header begins
CALL = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Paris"}<|call|>')
REPLY = f"{ANALYSIS}Two and two.{NEXT}{FINAL}It is 4.<|return|>"
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>"]

# (reply, reasoning, content)
EXAMPLES = [
    (REPLY, "Two and two.", "It is 4."),
    (f"{ANALYSIS}One.{NEXT}{ANALYSIS}Two.{NEXT}{FINAL}4<|return|>", "One.\nTwo.", "4"),
    (f"{ANALYSIS}Add the", "Add the", ""),  # cut by max_tokens: all reasoning
    (f"{ANALYSIS}A{NEXT}<|channel|>fin", "A", ""),  # cut inside the final header
    (f"{ANALYSIS}A{NEXT}{FINAL}", "A", ""),
    (f"{ANALYSIS}A{NEXT}{ANALYSIS}", "A", ""),  # an empty message cut: no "\n" yet
    (f"{ANALYSIS}{NEXT}{FINAL}x<|return|>", None, "x"),
    ("It is 4.", None, "It is 4."),  # no marker at all: all content
    ("  \n", None, "  \n"),
    ("", None, ""),
    ("<|cha", None, "<|cha"),
    (f"{ANALYSIS}Ask the tool.{NEXT}{CALL}", "Ask the tool.", ""),  # a tool call is neither
    (f"{ANALYSIS}W.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     "<|message|>{}<|call|>", "W.", ""),
    (f"<|channel|>commentary<|message|>Let me check.{NEXT}{FINAL}Done<|return|>", None,
     "Let me check.\nDone"),  # a preamble is part of the answer (vLLM's)
    (f"\n{ANALYSIS}a<|end|>", "a", ""),  # blanks before the first marker go
    (f"{FINAL}a <|b|> c <|x<|y| <|<|return|>", None, "a <|b|> c <|x<|y| <|"),
    ("Hi" + FINAL + "there<|return|>", None, "Hi\nthere"),
    (f"{FINAL}4<|endoftext|>", None, "4"),
    (f"{ANALYSIS}a<|channel|>final<|message|>b", "a", "b"),  # no <|end|> between
    (f"{FINAL}x <|en", None, "x <|en"),
    (f"<|channel|>secret<|message|>s<|end|>{FINAL}f", None, "f"),  # unknown channel
    ("<|message|>no channel", None, ""),
    (f"{ANALYSIS}<|reserved_200017|>r<|end|>", "r", ""),
    # the reply's first header names its recipient before its channel: a call, neither part
    (' to=functions.f<|channel|>commentary json<|message|>{"a":1}<|call|>', None, ""),
    (" to=functions.f<|channel|>comm", None, ""),  # cut inside that header
    ("to be or not", None, "to be or not"),  # no recipient: content
]


def token_pieces(text: str, rng: random.Random) -> list[str]:
    """`text` as a model streams it: each marker one piece, the text between cut anywhere."""
    pieces = []
    for part in re.split(r"(<\|[a-z_0-9]+\|>)", text):
        pieces += [part] if part.startswith("<|") else splits(part, rng) if part else []
    return pieces


@pytest.mark.parametrize(("text", "reasoning", "content"), EXAMPLES)
def test_whole_replies_split_by_channel(text, reasoning, content) -> None:
    assert split(text, HARMONY) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), EXAMPLES)
def test_any_stream_reassembles_to_the_whole_parse(text, reasoning, content) -> None:
    rng = random.Random(text)
    cuts = [[text], list(text), *(splits(text, rng) for _ in range(60)),
            *(token_pieces(text, rng) for _ in range(20))]
    for pieces in cuts:
        assert reassemble(stream(HARMONY, pieces)) == (reasoning, content), pieces


CALLS = REASONING_PARSERS["openai_gptoss"].replace("harmony:", "harmony+calls:", 1)
WEATHER = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": "Paris"}<|call|>')
TIME_CALL = ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": 2}<|call|>'
# (reply, reasoning, content, calls): with calls read (--tool-call-parser openai)
CALL_EXAMPLES = [
    (f"{ANALYSIS}Ask.{NEXT}{WEATHER}", "Ask.", None, [("get_weather", {"city": "Paris"})]),
    (TIME_CALL, None, None, [("get_time", {"zone": 2})]),  # recipient before the channel
    (f"<|channel|>commentary<|message|>Checking.{NEXT}{WEATHER}", None, "Checking.",
     [("get_weather", {"city": "Paris"})]),  # a preamble stays the answer
    (f"{WEATHER}<|start|>assistant{TIME_CALL}", None, None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 2})]),
    (f"{ANALYSIS}A{NEXT}<|channel|>commentary to=functions.f<|message|>{{\"x\": [1,",
     "A", '{"x": [1,', []),  # cut by max_tokens: arguments that do not parse stay content
    (f"{ANALYSIS}A{NEXT}<|channel|>commentary to=functions.f<|message|>[1]<|call|>",
     "A", "[1]", []),  # arguments that are no object: content
    (f"{ANALYSIS}A{NEXT}<|channel|>commentary to=browser.search<|message|>{{}}<|call|>",
     "A", None, []),  # a built-in tool's call is no function call: neither
    (REPLY, "Two and two.", "It is 4.", []),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CALL_EXAMPLES)
def test_calls_to_functions_are_read_whole_and_streamed(text, reasoning, content, calls) -> None:
    def read(pieces: list[str]) -> tuple[str | None, str | None, list]:
        """The reasoning, content and calls of the reply streamed in `pieces`; the framed
        content read by the tool parser whole and, cut anywhere, streamed: the same."""
        got_reasoning, framed = reassemble(stream(CALLS, pieces))
        content, calls = OpenAIToolParser.parse(framed)
        parser = OpenAIToolParser()
        deltas = [d for piece in splits(framed, rng) for d in parser.feed(piece)]
        streamed = accumulate([{"delta": d, "finish_reason": None}
                               for d in deltas + parser.finish()])
        assert streamed["content"] == (content or "")
        assert streamed["calls"] == [part for c in calls
                                     for part in ((c.name, ""), (None, c.arguments))]
        return got_reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]

    rng = random.Random(text)
    assert read([text]) == (reasoning, content, calls)
    for pieces in [list(text), *(splits(text, rng) for _ in range(30)),
                   *(token_pieces(text, rng) for _ in range(10))]:
        assert read(pieces) == (reasoning, content, calls), pieces
    assert split(text, HARMONY)[0] == reasoning  # without calls read: the same reasoning
    assert "<|" not in split(text, HARMONY)[1]


@pytest.mark.parametrize("seed", range(6))
def test_openai_answers_carry_harmony_calls_whole_and_streamed(seed) -> None:
    body = {**BODY, "tools": [TIME]}
    text = f"{ANALYSIS}The time, then.{NEXT}{TIME_CALL}"
    whole, chunks = answers(body, "openai_gptoss", text, seed, tool_parser="openai")
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"] == "The time, then."
    assert whole["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["message"]["tool_calls"]] == [("get_time", {"zone": 2})]
    got = accumulate(chunks)
    assert (got["reasoning_content"], got["content"]) == ("The time, then.", "")
    assert [(n, json.loads(a) if a else a) for n, a in got["calls"]] == [
        ("get_time", ""), (None, {"zone": 2})]
    assert "<|" not in json.dumps(chunks)
    no_tools, _ = answers(BODY, "openai_gptoss", text, seed, tool_parser="openai")
    assert no_tools["message"] == {"role": "assistant", "reasoning_content": "The time, then.",
                                   "content": None}  # no tools asked: the call is neither


def test_first_mode_and_the_request_switches(model) -> None:
    assert first_mode("openai_gptoss") == HARMONY
    assert first_mode("openai_gptoss", constrained=True) == HARMONY  # no marker: all content
    assert first_mode("openai_gptoss", calls=True) == CALLS
    with pytest.raises(ValueError, match="enable_thinking: false does not turn off gpt-oss"):
        first_mode("openai_gptoss", thinking=False)
    off = chat_request(chat_template_kwargs='{"enable_thinking": false}')
    with pytest.raises(InvalidArgument, match="^chat_template_kwargs.enable_thinking"):
        validate(off, model)
    on = validate(chat_request(chat_template_kwargs='{"enable_thinking": true}'), model)
    assert on.reasoning_mode == HARMONY
    reads_calls = dataclasses.replace(model, tool_call_parser="openai")
    tool = pdserve_pb2.Tool(name="get_time", parameters='{"type": "object"}')
    assert validate(chat_request(tools=[tool]), reads_calls).reasoning_mode == CALLS
    assert validate(chat_request(), reads_calls).reasoning_mode == HARMONY  # no tools
    required = pdserve_pb2.ToolChoice(required=True)  # a grammar shapes the reply: no harmony
    assert validate(chat_request(tools=[tool], tool_choice=required),
                    reads_calls).reasoning_mode == HARMONY
    assert validate(chat_request(tools=[tool]), model).reasoning_mode == HARMONY  # hermes


def test_reasoning_effort_reaches_the_template(model) -> None:
    def prompt(body: dict[str, Any]) -> str:
        valid = validate(parse_chat({**BODY, **body}).requests[0], model)
        return model.tokenizer.decode(valid.prompt_token_ids, skip_special_tokens=False)

    assert prompt({}).endswith("Reasoning: medium<|start|>assistant")
    assert prompt({"reasoning_effort": "low"}).endswith("Reasoning: low<|start|>assistant")
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
    assert prompt(kwargs).endswith("Reasoning: high<|start|>assistant")
    assert "Reasoning: high" in prompt({**kwargs, "reasoning_effort": "high"})
    with pytest.raises(BadParameter, match="reasoning_effort must be one of low, medium, high"):
        parse_chat({**BODY, "reasoning_effort": "max"})
    with pytest.raises(BadParameter, match="chat_template_kwargs.reasoning_effort says other"):
        parse_chat({**BODY, **kwargs, "reasoning_effort": "low"})


def test_openai_answers_whole_and_streamed() -> None:
    whole, chunks = answers(BODY, "openai_gptoss", REPLY, seed=3)
    assert whole["message"] == {"role": "assistant", "reasoning_content": "Two and two.",
                                "content": "It is 4."}
    got = accumulate(chunks)
    assert (got["reasoning_content"], got["content"]) == ("Two and two.", "It is 4.")
    assert "<|" not in json.dumps(chunks)
    whole, chunks = answers(BODY, "openai_gptoss", f"{ANALYSIS}Add the")  # cut: no answer
    assert whole["message"] == {"role": "assistant", "reasoning_content": "Add the",
                                "content": None}
    whole, chunks = answers({**BODY, "include_reasoning": False}, "openai_gptoss", REPLY)
    assert whole["message"] == {"role": "assistant", "content": "It is 4."}
    assert accumulate(chunks)["reasoning_content"] == ""


# ---------------------------------------------------------------- real detokenization

TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
            "{% endfor %}Reasoning: {{ reasoning_effort | default('medium') }}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_dir):
    """SmolLM2's byte-level BPE with harmony's markers added as special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def model(harmony_tokenizer) -> ModelContext:
    return ModelContext("gpt-oss", harmony_tokenizer, len(harmony_tokenizer), 512,
                        reasoning_parser="openai_gptoss")


def chat_request(**kwargs: Any) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        messages=[pdserve_pb2.ChatMessage(role="user", content="2 + 2?")], **kwargs)


def openai_stream(messages: list[pdserve_pb2.GenerateResponse]) -> list[dict[str, Any]]:
    """The OpenAI front's streamed choices for the router's messages."""
    choices = Choices(parse_chat({**BODY, "stream": True}), "m", TokenTexts(None), "hermes",
                      None, "openai_gptoss", [HARMONY])
    chunks = []
    for message in messages:
        assert choices.reads(0)  # never plain text: a marker may come at any point
        chunks += [c["choices"][0] for c in choices.read_chunks(0, message)]
    return chunks


@pytest.mark.parametrize("seed", range(4))
def test_router_keeps_the_markers_for_the_split_only(model, harmony_tokenizer, seed) -> None:
    tokenizer = harmony_tokenizer
    text = (f"{ANALYSIS}Two and two.{NEXT}{ANALYSIS}Four, then.{NEXT}{FINAL}It is "
            "4, naïve café.<|return|>")
    out = tokenizer(text, add_special_tokens=False).input_ids
    valid = validate(chat_request(), model)
    assert valid.params.skip_special_tokens  # the client's default
    sizes, rng = [], random.Random(seed)
    while sum(sizes) < len(out):
        sizes.append(rng.randint(1, 4) if seed else 1)  # seed 0: one token per message
    items, at = [], 0
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        items.append(delta(out[at:at + size], "stop" if last else ""))
        at += size
    run = run_stream(tokenizer, valid, items)
    assert run.text == text  # the raw reply, markers in it
    assert (run.last.reasoning_content, run.last.content) == (
        "Two and two.\nFour, then.", "It is 4, naïve café.")
    got = accumulate(openai_stream(run.messages))
    assert (got["reasoning_content"], got["content"]) == (
        "Two and two.\nFour, then.", "It is 4, naïve café.")
    plain = ValidRequest("req-1", valid.prompt_token_ids, SamplingParams(max_tokens=64), "")
    assert run_stream(tokenizer, plain, items).text == tokenizer.decode(
        out, skip_special_tokens=True)  # without the parser: as the client set it
