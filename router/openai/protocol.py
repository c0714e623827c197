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

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.validation import InvalidArgument, ValidRequest

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each fans out into n requests)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
INT32_MAX = 2**31 - 1
# Parameters pdserve does not implement: refused when they would change the answer, rather
# than silently ignored. Value: what "not set" looks like.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
               "logit_bias": None, "echo": False, "suffix": None, "tools": None,
               "functions": None, "best_of": None, "response_format": None,
               "prompt_logprobs": None}


class BadParameter(InvalidArgument):
    """A 400: `param` is the OpenAI parameter at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def from_router(cls, exc: InvalidArgument, max_tokens_param: str,
                    prompt_param: str) -> BadParameter:
        """The router's message, its field renamed to the parameter the client sent."""
        message = str(exc)
        field = re.match(r"[A-Za-z_]+", message.removeprefix("sampling."))
        name = field.group(0) if field else prompt_param
        if name == "max_tokens":
            name = max_tokens_param
        elif name in ("prompt", "prompt_token_ids", "messages"):
            name = prompt_param
        text = message.removeprefix("sampling.")
        if text.startswith("max_tokens"):
            text = max_tokens_param + text.removeprefix("max_tokens")
        return cls(name, text)


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
    return _request(body, True, [base], logprobs, max_param, "messages", session_header)


def parse_completion(body: Any, session_header: str = "") -> OpenAIRequest:
    body = _object(body)
    if "prompt" not in body:
        raise BadParameter("prompt", "prompt: required")
    logprobs = _int(body, "logprobs", 0, 20)
    sampling = _sampling(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, logprobs)
    bases = []
    for prompt in _prompts(body["prompt"]):
        base = pdserve_pb2.GenerateRequest(sampling=sampling)
        if isinstance(prompt, str):
            base.prompt = prompt
        else:
            base.prompt_token_ids.extend(prompt)
        bases.append(base)
    return _request(body, False, bases, logprobs, "max_tokens", "prompt", session_header)


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
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    for p, base in enumerate(bases):
        base.request_id, base.model, base.session_id = f"{response_id}-{p}", model, session
    return OpenAIRequest(chat, response_id, model, tuple(bases), n, stream, include_usage,
                         logprobs, max_param, prompt_param, timeout)


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
    return msg


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
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise BadParameter("messages", f"messages[{i}].content: only text parts are "
                                           "supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadParameter("messages", f"messages[{i}].content must be a string or text parts")
    return pdserve_pb2.ChatMessage(role=role, content=content)


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
