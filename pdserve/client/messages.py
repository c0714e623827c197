"""What a client call returns, and its conversions to and from the public protobuf messages.

`build_request` makes the GenerateRequest; `chunk_from_proto` turns each streamed
GenerateResponse into a `GenerateChunk`; `collect` joins a stream's chunks into a `Completion`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.proto import pdserve_pb2
from pdserve.wire import logprobs_from_proto, sampling_to_proto


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from a prefix cache


@dataclass(frozen=True)
class Timings:
    queue_s: float  # waiting for admission
    ttft_s: float  # request received -> first token sent
    e2e_s: float  # request received -> last message


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: the new text and tokens since the previous chunk.

    finish_reason ("stop" | "length" | "abort" | "tool_calls"), usage, timings, and the tool
    calls read from the reply (with `content`, the text outside them) come on the last chunk
    only; prompt logprobs (when asked) on the first. With the router's --reasoning-parser, a
    chat's last chunk has `reasoning_content` (None: no reasoning) and `content`, the answer.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None
    reasoning_content: str | None = None


@dataclass(frozen=True)
class Completion:
    """A whole answer: what `complete` returns."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: str | None
    usage: Usage | None
    timings: Timings | None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # positions 1.., when asked
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None  # with tool calls: the text outside them; after the reasoning
    reasoning_content: str | None = None  # the reply's <think> block (--reasoning-parser)


def build_request(
    prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
    sampling: SamplingParams | None = None, session_id: str = "", request_id: str = "",
    model: str = "", tools: Sequence[dict] | None = None, tool_choice: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> pdserve_pb2.GenerateRequest:
    """The GenerateRequest; with `sampling` None no sampling field is sent (server defaults).

    `messages` are OpenAI's chat messages (an assistant turn's `tool_calls`, a tool turn's
    `tool_call_id` included); `tools` OpenAI's function tools; `tool_choice` "none", "auto",
    "required" or a function's name; `chat_template_kwargs` the chat template's extra
    variables (e.g. {"enable_thinking": False})."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    request = pdserve_pb2.GenerateRequest(request_id=request_id, session_id=session_id,
                                          model=model)
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        request.prompt_token_ids.extend(int(t) for t in prompt)
    else:
        for m in messages:  # type: ignore[union-attr]
            message = request.messages.add(role=m["role"], content=m.get("content") or "",
                                           tool_call_id=m.get("tool_call_id") or "",
                                           name=m.get("name") or "")
            for call in m.get("tool_calls") or ():
                message.tool_calls.add(id=call.get("id", ""), name=call["function"]["name"],
                                       arguments=call["function"].get("arguments", ""))
    for tool in tools or ():
        function = tool["function"]
        request.tools.add(name=function["name"], description=function.get("description", ""),
                          parameters=json.dumps(function.get("parameters", {})))
    if tool_choice in ("none", "auto", "required"):
        setattr(request.tool_choice, tool_choice, True)
    elif tool_choice is not None:
        request.tool_choice.function = tool_choice
    if chat_template_kwargs:
        request.chat_template_kwargs = json.dumps(chat_template_kwargs)
    if sampling is not None:
        request.sampling.CopyFrom(sampling_to_proto(sampling))
    return request


def chunk_from_proto(msg: pdserve_pb2.GenerateResponse) -> GenerateChunk:
    usage = timings = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    if msg.HasField("timings"):
        t = msg.timings
        timings = Timings(t.queue_s, t.ttft_s, t.e2e_s)
    return GenerateChunk(
        request_id=msg.request_id, text=msg.text, token_ids=tuple(msg.token_ids),
        logprobs=tuple(logprobs_from_proto(lp) for lp in msg.logprobs),
        finish_reason=msg.finish_reason or None, stop_reason=msg.stop_reason or None,
        usage=usage, timings=timings,
        prompt_logprobs=tuple(logprobs_from_proto(lp) for lp in msg.prompt_logprobs),
        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls),
        content=msg.content or None,
        reasoning_content=msg.reasoning_content or None,
    )


def collect(chunks: Iterable[GenerateChunk]) -> Completion:
    """Joins a stream's chunks; the final fields come from the last chunk."""
    chunks = list(chunks)
    last = chunks[-1] if chunks else GenerateChunk("", "", ())
    return Completion(
        request_id=last.request_id, text="".join(c.text for c in chunks),
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        logprobs=tuple(lp for c in chunks for lp in c.logprobs),
        finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        usage=last.usage, timings=last.timings,
        prompt_logprobs=tuple(lp for c in chunks for lp in c.prompt_logprobs),
        tool_calls=last.tool_calls, content=last.content,
        reasoning_content=last.reasoning_content,
    )
