"""Everything about a Generate request is checked here, before any worker holds state for it.

Each refusal is an InvalidArgument naming the field (`prompt`, `sampling.top_p`, ...), which
the servicer returns as INVALID_ARGUMENT. Requests whose strings are not UTF-8 never parse as
pdserve.v1 messages: `parse_generate_request` re-reads them as raw bytes to name the field.

Every client-given size is bounded (`RequestLimits`, ids): stop strings are scanned on every
streamed token on the router's event loop and stop ids travel in every tensor-parallel plan,
so their count and length are capped before anything else is done with the request.
A session id is scoped by the caller's tenant (`pdserve.redis_keys.scoped_session_id`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import DecodeError

from pdserve.engine.config import load_model_config
from pdserve.engine.input_processor import chat_prompt, check_prompt_length, tokenize_prompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto import pdserve_pb2, raw_pb2
from pdserve.redis_keys import PUBLIC_TENANT, scoped_session_id
from pdserve.wire import sampling_from_proto

MAX_REQUEST_ID_CHARS = 128  # room for the router's retry suffix in a 256-char worker id
MAX_ID_CHARS = 256  # session_id


class InvalidArgument(ValueError):
    """A request the router refuses; the message starts with the field's name."""


@dataclass(frozen=True)
class ModelContext:
    """What the router knows of the served model: its tokenizer and limits (no weights)."""

    name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    dtype: str = "float32"  # as served (resolved: never "auto")
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def load(cls, path: str, name: str, dtype: str = "auto",
             max_model_len: int | None = None) -> ModelContext:
        config = load_model_config(path, dtype, max_model_len)
        return cls(name, load_tokenizer(path), config.vocab_size,
                   config.max_model_len, config.dtype, config.eos_token_ids)


@dataclass(frozen=True)
class RequestLimits:
    """Caps on client-given lists (settings max_stop_strings, ...)."""

    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = RequestLimits()


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    session_id: str
    # a migrated request: the prompt's last this-many tokens were generated (and streamed)
    # by a decode worker that died; the worker-plane field of the same name
    num_output_tokens: int = 0

    def continued(self, output_token_ids: Sequence[int]) -> ValidRequest:
        """This request as another decode worker takes it over after `output_token_ids` were
        streamed: those tokens become its prompt's tail (generated elsewhere, so seeded
        sampling continues after them) and max_tokens counts only what is left."""
        num_done = len(output_token_ids)
        if not 0 <= num_done < self.params.max_tokens:
            raise ValueError(f"a request continues after 0..{self.params.max_tokens - 1} "
                             f"generated tokens, got {num_done}")
        return replace(self, prompt_token_ids=self.prompt_token_ids + tuple(output_token_ids),
                       params=replace(self.params, max_tokens=self.params.max_tokens - num_done),
                       num_output_tokens=self.num_output_tokens + num_done)


def parse_generate_request(data: bytes) -> pdserve_pb2.GenerateRequest | InvalidArgument:
    """The server's deserializer: the message, or the reason it can't be read (not raised, so
    the servicer can answer INVALID_ARGUMENT instead of gRPC's INTERNAL)."""
    try:
        return pdserve_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return InvalidArgument(_bad_utf8_field(data) or f"request: unreadable message ({exc})")


def _bad_utf8_field(data: bytes) -> str | None:
    try:
        raw = raw_pb2.RawGenerateRequest.FromString(data)
    except DecodeError:
        return None
    fields = [("request_id", raw.request_id), ("session_id", raw.session_id),
              ("model", raw.model), ("prompt", raw.prompt)]
    for i, m in enumerate(raw.messages):
        fields += [(f"messages[{i}].role", m.role), (f"messages[{i}].content", m.content)]
    fields += [(f"sampling.stop[{i}]", s) for i, s in enumerate(raw.sampling.stop)]
    for name, value in fields:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"{name} is not valid UTF-8 (byte {exc.start})"
    return None


def validate(request: pdserve_pb2.GenerateRequest, model: ModelContext,
             limits: RequestLimits = DEFAULT_LIMITS,
             tenant: str = PUBLIC_TENANT) -> ValidRequest:
    """Token ids and checked SamplingParams of a request, or InvalidArgument naming the field.
    `tenant` is the caller's (router.auth): the returned session id lives in its namespace."""
    request_id = (_check_id("request_id", request.request_id, MAX_REQUEST_ID_CHARS)
                  or f"req-{uuid.uuid4().hex}")
    session_id = scoped_session_id(tenant, _check_id("session_id", request.session_id))
    check_limits(request.sampling, limits)
    if request.model and request.model != model.name:
        raise InvalidArgument(
            f"model {request.model!r} is not served here; this router serves {model.name!r}"
        )
    prompt_ids = _prompt_ids(request, model)
    try:
        check_prompt_length(len(prompt_ids), model.max_model_len)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    room = model.max_model_len - len(prompt_ids)
    sampling = request.sampling
    try:
        params = sampling_from_proto(sampling, default_max_tokens=room)
    except ValueError as exc:
        raise InvalidArgument(f"sampling.{exc}") from None
    if params.max_tokens > room:
        raise InvalidArgument(
            f"sampling.max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens "
            f"({params.max_tokens}) exceeds max_model_len ({model.max_model_len})"
        )
    for token_id in params.stop_token_ids:
        if token_id >= model.vocab_size:
            raise InvalidArgument(f"sampling.stop_token_ids: {token_id} is outside the vocabulary")
    return ValidRequest(request_id, tuple(prompt_ids), params, session_id)


def _prompt_ids(request: pdserve_pb2.GenerateRequest, model: ModelContext) -> list[int]:
    given = [name for name, present in (
        ("prompt", request.HasField("prompt")),
        ("prompt_token_ids", bool(request.prompt_token_ids)),
        ("messages", bool(request.messages)),
    ) if present]
    if len(given) != 1:
        raise InvalidArgument(
            "prompt: give exactly one of prompt, prompt_token_ids, messages"
            + (f" (got {', '.join(given)})" if given else " (got none, or an empty one)")
        )
    try:
        if given[0] == "messages":
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            return chat_prompt(messages, model.tokenizer)
        prompt = request.prompt if given[0] == "prompt" else list(request.prompt_token_ids)
        return tokenize_prompt(prompt, model.tokenizer, model.vocab_size)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_limits(sampling: pdserve_pb2.SamplingParams, limits: RequestLimits) -> None:
    """The stop lists within their caps (checked first: cheap, before any tokenizer work)."""
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"sampling.stop: {len(sampling.stop)} stop strings; the limit "
                              f"is {limits.max_stop_strings}")
    for i, text in enumerate(sampling.stop):
        if len(text) > limits.max_stop_string_chars:
            raise InvalidArgument(f"sampling.stop[{i}] is {len(text)} characters; the limit "
                                  f"is {limits.max_stop_string_chars}")
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(f"sampling.stop_token_ids: {len(sampling.stop_token_ids)} ids; "
                              f"the limit is {limits.max_stop_token_ids}")


def _check_id(name: str, value: str, limit: int = MAX_ID_CHARS) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{name} is {len(value)} characters; the limit is {limit}")
    return value
