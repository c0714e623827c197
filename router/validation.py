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

import functools
import inspect
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf.message import DecodeError

from pdserve.engine.config import load_model_config
from pdserve.engine.input_processor import (
    chat_prompt,
    check_prompt_length,
    prepare_params,
    tokenize_prompt,
)
from pdserve.engine.lora_request import LoRARequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_outputs_params import StructuredOutputsParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto import pdserve_pb2, raw_pb2
from pdserve.redis_keys import PUBLIC_TENANT, scoped_session_id
from pdserve.router.invalid_argument import InvalidArgument
from pdserve.router.lora_adapters import LoRAAdapters
from pdserve.router.reasoning import check_parser, enable_thinking, first_mode
from pdserve.router.tools import ToolRequest, forced_schema, parse_tools
from pdserve.wire import sampling_from_proto

MAX_REQUEST_ID_CHARS = 128  # room for the router's retry suffix in a 256-char worker id
MAX_ID_CHARS = 256  # session_id


@dataclass(frozen=True)
class ModelContext:
    """What the router knows of the served model: its tokenizer and limits (no weights), and
    the LoRA adapters served over it (None: LoRA not enabled)."""

    name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    dtype: str = "float32"  # as served (resolved: never "auto")
    eos_token_ids: tuple[int, ...] = ()
    tool_call_parser: str = "hermes"  # the chat template's tool-call format (router.tools)
    loras: LoRAAdapters | None = field(default=None, compare=False)
    reasoning_parser: str | None = None  # chat replies' reasoning split off (router.reasoning)

    def __post_init__(self) -> None:
        check_parser(self.reasoning_parser)

    @classmethod
    def load(cls, path: str, name: str, dtype: str = "auto", max_model_len: int | None = None,
             tool_call_parser: str = "hermes", max_lora_rank: int | None = None,
             lora_modules: dict[str, str] | None = None,
             reasoning_parser: str | None = None) -> ModelContext:
        """`max_lora_rank` None: LoRA not enabled; else `lora_modules` (name -> path) are
        served from the start (ValueError naming a bad one)."""
        config = load_model_config(path, dtype, max_model_len)
        loras = None if max_lora_rank is None else LoRAAdapters(
            config, name, max_lora_rank, lora_modules or {})
        return cls(name, load_tokenizer(path), config.vocab_size, config.max_model_len,
                   config.dtype, config.eos_token_ids, tool_call_parser, loras,
                   reasoning_parser)

    def lora(self, name: str) -> LoRARequest | None:
        """The adapter a request's `model` names: None for the base model (or no name);
        InvalidArgument when it names nothing served here."""
        if not name or name == self.name:
            return None
        lora = self.loras.get(name) if self.loras is not None else None
        if lora is None:
            served = [self.name, *(a.lora_name for a in self.loras or ())]
            raise InvalidArgument(f"model {name!r} is not served here; this router serves "
                                  f"{', '.join(map(repr, served))}")
        return lora


@dataclass(frozen=True)
class RequestLimits:
    """Caps on client-given lists (settings max_stop_strings, ...)."""

    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # OpenAI's
    max_bad_words: int = 64
    max_grammar_bytes: int = 65536  # a structured output's schema, regex or grammar

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                     "max_logit_bias", "max_bad_words", "max_grammar_bytes"):
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
    tools: ToolRequest | None = None  # the answer is read for tool calls (not for "none")
    tool_call_parser: str = "hermes"
    lora: LoRARequest | None = None  # the LoRA adapter the request's `model` names
    # the reply's reasoning is split off from this scanner mode (router.reasoning); None: not
    reasoning_mode: str | None = None

    def continued(self, output_token_ids: Sequence[int]) -> ValidRequest:
        """This request as another decode worker takes it over after `output_token_ids` were
        streamed: those tokens become its prompt's tail (generated elsewhere, so seeded
        sampling continues after them) and max_tokens counts only what is left."""
        num_done = len(output_token_ids)
        if not 0 <= num_done < self.params.max_tokens:
            raise ValueError(f"a request continues after 0..{self.params.max_tokens - 1} "
                             f"generated tokens, got {num_done}")
        return replace(self, prompt_token_ids=self.prompt_token_ids + tuple(output_token_ids),
                       params=replace(self.params, max_tokens=self.params.max_tokens - num_done,
                                      min_tokens=max(self.params.min_tokens - num_done, 0),
                                      # sent with the first token
                                      prompt_logprobs=self.params.prompt_logprobs
                                      if num_done == 0 else None),
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
              ("model", raw.model), ("prompt", raw.prompt),
              ("chat_template_kwargs", raw.chat_template_kwargs)]
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
    lora = model.lora(request.model)
    tools = _request_tools(request)
    if tools is not None and not request.messages:
        raise InvalidArgument("tools: tools need messages (the chat template renders them)")
    template_kwargs = _template_kwargs(request)
    prompt_ids = _prompt_ids(request, model, tools, template_kwargs)
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
    forced = forced_schema(tools) if tools is not None else None
    if forced is not None:
        if len(forced) > limits.max_grammar_bytes:
            raise InvalidArgument(f"tools: the forced choice's schema is {len(forced)} bytes; "
                                  f"the limit is {limits.max_grammar_bytes}")
        if params.structured_outputs is not None:
            raise InvalidArgument("tool_choice: a forced tool choice and structured_outputs "
                                  "both shape the output: give one")
        params = replace(params, structured_outputs=StructuredOutputsParams(json=forced))
    try:
        params = prepare_params(params, model.tokenizer, model.vocab_size)
    except ValueError as exc:
        raise InvalidArgument(f"sampling.{exc}") from None
    try:
        reasoning = first_mode(
            model.reasoning_parser, enable_thinking(template_kwargs),
            params.structured_outputs is not None,
            calls=model.tool_call_parser == "openai" and tools is not None
            and tools.choice == "auto") if request.messages else None
    except ValueError as exc:  # thinking turned off where it cannot be
        raise InvalidArgument(str(exc)) from None
    return ValidRequest(request_id, tuple(prompt_ids), params, session_id,
                        tools=tools if tools is not None and tools.choice != "none" else None,
                        tool_call_parser=model.tool_call_parser, lora=lora,
                        reasoning_mode=reasoning)


def _chat_message(m: pdserve_pb2.ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: a call's arguments as an object (templates
    write them with tojson), a tool turn with the id of the call it answers."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _json_or_text(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    if m.name:
        message["name"] = m.name
    return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _request_tools(request: pdserve_pb2.GenerateRequest) -> ToolRequest | None:
    """The request's tools and tool choice, checked as the OpenAI front checks them."""
    if not request.tools and not request.HasField("tool_choice"):
        return None
    functions = []
    for i, tool in enumerate(request.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except ValueError:
                raise InvalidArgument(f"tools[{i}].parameters is not JSON") from None
        functions.append({"type": "function", "function": function})
    body: dict[str, Any] = {"tools": functions}
    kind = request.tool_choice.WhichOneof("kind")
    if kind == "function":
        body["tool_choice"] = {"type": "function",
                               "function": {"name": request.tool_choice.function}}
    elif kind is not None:
        body["tool_choice"] = kind
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return parse_tools(body)


def _template_kwargs(request: pdserve_pb2.GenerateRequest) -> dict[str, Any]:
    """The request's chat_template_kwargs, checked: a JSON object for a chat, its keys none
    of those the template call itself takes (the server sets those)."""
    if not request.chat_template_kwargs:
        return {}
    if not request.messages:
        raise InvalidArgument("chat_template_kwargs: needs messages (the chat template takes "
                              "them)")
    try:
        kwargs = json.loads(request.chat_template_kwargs)
    except (ValueError, RecursionError):
        raise InvalidArgument("chat_template_kwargs is not JSON") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat_template_kwargs must be a JSON object")
    reserved = sorted(set(kwargs) & _template_call_parameters())
    if reserved:
        raise InvalidArgument(f"chat_template_kwargs: {', '.join(reserved)} set by the server, "
                              "not by a request")
    try:
        enable_thinking(kwargs)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return kwargs


@functools.cache
def _template_call_parameters() -> frozenset[str]:
    """The parameters of transformers' apply_chat_template (tokenize, chat_template, ...)
    and the template's own `messages`: a request's template variables must not reach them."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset({"messages", "conversations"} | {
        name for name, p in parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"})


class _TemplateVariables:
    """A tokenizer whose chat template renders with a request's extra variables: chat_prompt
    (the engine's) takes none, so they ride on the tokenizer it is given. Everything else is
    the tokenizer's own."""

    def __init__(self, tokenizer: Any, variables: dict[str, Any]) -> None:
        self._tokenizer, self._variables = tokenizer, variables

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(*args, **{**self._variables, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _prompt_ids(request: pdserve_pb2.GenerateRequest, model: ModelContext,
                tools: ToolRequest | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
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
            messages = [_chat_message(m) for m in request.messages]
            tokenizer = (_TemplateVariables(model.tokenizer, template_kwargs) if template_kwargs
                         else model.tokenizer)
            return chat_prompt(messages, tokenizer, tools and tools.tools)
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
    if len(sampling.logit_bias) > limits.max_logit_bias:
        raise InvalidArgument(f"sampling.logit_bias: {len(sampling.logit_bias)} entries; the "
                              f"limit is {limits.max_logit_bias}")
    if len(sampling.bad_words) > limits.max_bad_words or any(
            len(w) > limits.max_stop_string_chars for w in sampling.bad_words):
        raise InvalidArgument(f"sampling.bad_words: at most {limits.max_bad_words} words of "
                              f"at most {limits.max_stop_string_chars} characters")
    if sampling.bad_words_token_ids:
        raise InvalidArgument("sampling.bad_words_token_ids: set by the router from bad_words; "
                              "leave it empty")
    spec = sampling.structured_outputs
    if spec.ByteSize() > limits.max_grammar_bytes:
        raise InvalidArgument(f"sampling.structured_outputs: {spec.ByteSize()} bytes; the "
                              f"limit is {limits.max_grammar_bytes}")


def _check_id(name: str, value: str, limit: int = MAX_ID_CHARS) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{name} is {len(value)} characters; the limit is {limit}")
    return value
