"""OpenAI request bodies -> the router's own GenerateRequests. Pure: no I/O, no torch.

Every JSON value is type-checked here, so a bad one is a 400 naming the OpenAI parameter (a
mistyped value must not reach protobuf, which would raise a TypeError). The ranges are left
to the router's validation, the same that gRPC requests get; `BadParameter.from_router`
translates its field names (`sampling.top_p`) back into OpenAI's (`top_p`).

Each prompt becomes one router request, validated (and tokenized) once; `choices` then fans
it out into `n` router requests, `<id>-<prompt>-<choice>`. With a seed, choice i samples with
seed + i, so the choices differ and the whole answer is reproducible.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.invalid_argument import BadParameter
from pdserve.router.tools import ToolRequest, parse_tools
from pdserve.router.validation import ValidRequest

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each fans out into n requests)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
INT32_MAX = 2**31 - 1
# Parameters pdserve does not implement: refused when they would change the answer, rather
# than silently ignored. Value: what "not set" looks like.
UNSUPPORTED = {"suffix": None, "functions": None, "function_call": None, "best_of": None}
REASONING_EFFORTS = ("low", "medium", "high")  # vLLM's; gpt-oss's template reads them


@dataclass(frozen=True)
class OpenAIRequest:
    """One parsed /v1/completions or /v1/chat/completions call."""

    chat: bool
    response_id: str
    model: str
    requests: tuple[pdserve_pb2.GenerateRequest, ...]  # one per prompt
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token to return; None: no logprobs
    max_tokens_param: str
    prompt_param: str
    timeout_s: float | None
    structured_param: str = "structured_outputs"  # or response_format: what the client sent
    tools: ToolRequest | None = None  # chat: its replies are read for tool calls
    echo: bool = False  # completions: the prompt leads each choice's text (and logprobs)
    prompt_logprobs: int | None = None  # vLLM's: each choice carries its prompt's
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content from the answer


def parse_chat(body: Any, session_header: str = "") -> OpenAIRequest:
    body = _object(body)
    messages = _get(body, "messages", list)
    if messages is None or not messages:
        raise BadParameter("messages", "messages: a non-empty list is required")
    proto_messages = [_chat_message(i, m) for i, m in enumerate(messages)]
    logprobs = _chat_logprobs(body)
    max_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    sampling = _sampling(body, max_param, None, logprobs)
    base = pdserve_pb2.GenerateRequest(messages=proto_messages, sampling=sampling)
    template_kwargs = _template_kwargs(body)
    if template_kwargs:  # checked by the router, which renders the template
        base.chat_template_kwargs = json.dumps(template_kwargs)
    tools = parse_tools(body)
    if tools is not None:
        _add_tools(base, tools)
    include_reasoning = _get(body, "include_reasoning", bool)
    return replace(_request(body, True, [base], logprobs, max_param, "messages",
                            session_header), tools=tools,
                   include_reasoning=include_reasoning is not False)


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs, with vLLM's top-level `reasoning_effort` among them (gpt-oss's
    template reads it)."""
    kwargs = dict(_get(body, "chat_template_kwargs", dict) or {})
    effort = _get(body, "reasoning_effort", str)
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise BadParameter("reasoning_effort", f"reasoning_effort must be one of "
                           f"{', '.join(REASONING_EFFORTS)}, got {effort!r}")
    if kwargs.setdefault("reasoning_effort", effort) != effort:
        raise BadParameter("reasoning_effort", "reasoning_effort: chat_template_kwargs."
                           "reasoning_effort says otherwise: give one")
    return kwargs


def _add_tools(request: pdserve_pb2.GenerateRequest, tools: ToolRequest) -> None:
    for tool in tools.tools:
        function = tool["function"]
        request.tools.add(name=function["name"], description=function.get("description", ""),
                          parameters=json.dumps(tools.schemas[function["name"]]))
    if tools.choice == "function":
        request.tool_choice.function = tools.function
    else:
        setattr(request.tool_choice, tools.choice, True)
    request.parallel_tool_calls = tools.parallel_tool_calls


def parse_completion(body: Any, session_header: str = "") -> OpenAIRequest:
    body = _object(body)
    if "prompt" not in body:
        raise BadParameter("prompt", "prompt: required")
    logprobs = _int(body, "logprobs", 0, 20)
    sampling = _sampling(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, logprobs)
    echo = bool(_get(body, "echo", bool))
    if echo and logprobs is not None:  # the echoed prompt's tokens come with theirs
        sampling.prompt_logprobs = max(sampling.prompt_logprobs, logprobs)
    bases = []
    for prompt in _prompts(body["prompt"]):
        base = pdserve_pb2.GenerateRequest(sampling=sampling)
        if isinstance(prompt, str):
            base.prompt = prompt
        else:
            base.prompt_token_ids.extend(prompt)
        bases.append(base)
    return replace(_request(body, False, bases, logprobs, "max_tokens", "prompt",
                            session_header), echo=echo)


def _asked_prompt_logprobs(body: Mapping[str, Any]) -> int | None:
    return _int(body, "prompt_logprobs", 0, 20)


def _request(body: Mapping[str, Any], chat: bool, bases: list[pdserve_pb2.GenerateRequest],
             logprobs: int | None, max_param: str, prompt_param: str,
             session_header: str) -> OpenAIRequest:
    for name, unset in UNSUPPORTED.items():
        if body.get(name, unset) not in (unset, None):
            raise BadParameter(name, f"{name}: not supported by pdserve")
    model = _get(body, "model", str) or ""
    _get(body, "user", str)  # accepted (OpenAI's end-user id), checked, not used
    n = _int(body, "n", 1, MAX_N) or 1
    stream = bool(_get(body, "stream", bool))
    options = _get(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise BadParameter("stream_options", "stream_options.include_usage must be a boolean")
    session = _get(body, "session_id", str) or session_header
    timeout = _get(body, "timeout", (int, float))
    if timeout is not None and not timeout > 0:
        raise BadParameter("timeout", f"timeout must be > 0 seconds, got {timeout}")
    prompt_logprobs = _asked_prompt_logprobs(body)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    for p, base in enumerate(bases):
        base.request_id, base.model, base.session_id = f"{response_id}-{p}", model, session
    return OpenAIRequest(chat, response_id, model, tuple(bases), n, stream, include_usage,
                         logprobs, max_param, prompt_param, timeout,
                         "response_format" if "response_format" in body else "structured_outputs",
                         prompt_logprobs=prompt_logprobs)


def choices(valid: ValidRequest, n: int) -> list[ValidRequest]:
    """The `n` router requests of one validated prompt; choice i samples with seed + i."""
    seed = valid.params.seed
    return [replace(valid, request_id=f"{valid.request_id}-{c}",
                    params=replace(valid.params, seed=None if seed is None
                                   else (seed + c) % 2**63))
            for c in range(n)]


def _sampling(body: Mapping[str, Any], max_param: str, default_max: int | None,
              logprobs: int | None) -> pdserve_pb2.SamplingParams:
    msg = pdserve_pb2.SamplingParams()
    max_tokens = _int(body, max_param, None, INT32_MAX)
    if max_tokens is None:
        max_tokens = default_max
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p"):
        value = _get(body, name, (int, float))
        if value is not None:
            setattr(msg, name, value)
    top_k = _int(body, "top_k", None, INT32_MAX)
    if top_k is not None:
        msg.top_k = top_k
    seed = _int(body, "seed", None, 2**63 - 1)
    if seed is not None:
        msg.seed = seed
    stop = _get(body, "stop", (str, list))
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(s, str) for s in stop):
        raise BadParameter("stop", "stop must be a string or a list of strings")
    msg.stop.extend(stop)
    msg.stop_token_ids.extend(_int_list(body, "stop_token_ids"))
    msg.ignore_eos = bool(_get(body, "ignore_eos", bool))
    skip_special = _get(body, "skip_special_tokens", bool)
    if skip_special is not None:
        msg.skip_special_tokens = skip_special
    if logprobs is not None:
        msg.logprobs = logprobs
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _get(body, name, (int, float))
        if value is not None:
            setattr(msg, name, value)
    prompt_logprobs = _asked_prompt_logprobs(body)
    if prompt_logprobs is not None:
        msg.prompt_logprobs = prompt_logprobs
    min_tokens = _int(body, "min_tokens", 0, INT32_MAX)
    if min_tokens is not None:
        msg.min_tokens = min_tokens
    msg.logit_bias.update(_logit_bias(body))
    bad_words = _get(body, "bad_words", list) or []
    if not all(isinstance(w, str) for w in bad_words):
        raise BadParameter("bad_words", "bad_words must be a list of strings")
    msg.bad_words.extend(bad_words)
    _structured_outputs(body, msg.structured_outputs)
    return msg


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's {"token id": bias}; the range and the vocabulary are the router's checks."""
    bias = _get(body, "logit_bias", dict) or {}
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) <= INT32_MAX):
            raise BadParameter("logit_bias", f"logit_bias: key {key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadParameter("logit_bias", f"logit_bias[{key}] must be a number")
        out[int(key)] = value
    return out


def _structured_outputs(body: Mapping[str, Any], msg: pdserve_pb2.StructuredOutputs) -> None:
    """OpenAI's response_format, or vLLM's structured_outputs (one kind), into `msg`."""
    fmt = _get(body, "response_format", dict)
    spec = _get(body, "structured_outputs", dict)
    if fmt is not None and spec is not None:
        raise BadParameter("response_format", "response_format and structured_outputs: give "
                                              "one")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            msg.json_object = True
        elif kind == "json_schema":
            schema = fmt.get("json_schema")
            if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
                raise BadParameter("response_format", "response_format.json_schema must be an "
                                                      "object with a `schema` object")
            msg.json = json.dumps(schema.get("schema", {}))
        elif kind != "text":
            raise BadParameter("response_format", "response_format.type must be text, "
                                                  f"json_object or json_schema, got {kind!r}")
        return
    if spec is None:
        return
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
             if spec.get(k) not in (None, False)]
    if len(given) != 1 or set(spec) - {"json", "regex", "choice", "grammar", "json_object"}:
        raise BadParameter("structured_outputs", "structured_outputs: give exactly one of "
                                                 "json, regex, choice, grammar, json_object")
    kind, value = given[0], spec[given[0]]
    if kind == "json" and isinstance(value, dict):
        value = json.dumps(value)
    ok = {"json": str, "regex": str, "grammar": str, "choice": list, "json_object": bool}[kind]
    if not isinstance(value, ok) or (kind == "choice"
                                     and not all(isinstance(c, str) for c in value)):
        raise BadParameter("structured_outputs", f"structured_outputs.{kind} has the wrong type")
    if kind == "choice":
        msg.choice.choices.extend(value)
    else:
        setattr(msg, kind, value)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = _get(body, "logprobs", bool)
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not wanted:
        raise BadParameter("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _chat_message(i: int, message: Any) -> pdserve_pb2.ChatMessage:
    if not isinstance(message, dict):
        raise BadParameter("messages", f"messages[{i}] must be an object")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise BadParameter("messages", f"messages[{i}].role must be a string")
    calls = message.get("tool_calls") or []
    if content is None and calls:  # an assistant turn that only called tools
        content = ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise BadParameter("messages", f"messages[{i}].content: only text parts are "
                                           "supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadParameter("messages", f"messages[{i}].content must be a string or text parts")
    proto = pdserve_pb2.ChatMessage(role=role, content=content)
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str)
                and isinstance(call.get("id", ""), str)):
            raise BadParameter("messages", f"messages[{i}].tool_calls: each needs an id, and a "
                                           "function with a name and arguments (JSON text)")
        proto.tool_calls.add(id=call.get("id", ""), name=function["name"],
                             arguments=function.get("arguments", ""))
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            raise BadParameter("messages", f"messages[{i}].{name} must be a string")
        setattr(proto, name, value or "")
    return proto


def _prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's four prompt shapes: text, token ids, and a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [_token_ids(prompt)]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS:  # a list of prompts (a list of ids returned above)
            raise BadParameter("prompt", f"prompt: {len(prompt)} prompts; the limit is "
                                         f"{MAX_PROMPTS} per request")
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return [_token_ids(p) for p in prompt]
    raise BadParameter("prompt", "prompt must be a string, a list of token ids, or a "
                                 "non-empty list of either")


def _token_ids(ids: list[int]) -> list[int]:
    if any(not 0 <= t <= INT32_MAX for t in ids):
        raise BadParameter("prompt", "prompt: token ids must be in [0, 2**31)")
    return ids


def _int_list(body: Mapping[str, Any], name: str) -> list[int]:
    values = _get(body, name, list) or []
    if not all(_is_int(v) and 0 <= v <= INT32_MAX for v in values):
        raise BadParameter(name, f"{name} must be a list of non-negative integers")
    return values


def _int(body: Mapping[str, Any], name: str, low: int | None, high: int) -> int | None:
    value = _get(body, name, int)
    if value is not None and not (low if low is not None else -INT32_MAX - 1) <= value <= high:
        raise BadParameter(name, f"{name} must be in [{low}, {high}], got {value}")
    return value


def _get(body: Mapping[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in wanted:  # JSON true is not a number here
        raise BadParameter(name, f"{name} must be {_describe(wanted)}, got {value!r}")
    if not isinstance(value, wanted):
        raise BadParameter(name, f"{name} must be {_describe(wanted)}, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "a list", dict: "an object"}
    return " or ".join(names[t] for t in types)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise BadParameter("body", "the request body must be a JSON object")
    return body
