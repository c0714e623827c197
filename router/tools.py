"""OpenAI tool calling for /v1/chat/completions, as vLLM serves it. Pure: no I/O, no torch.

The request side: `parse_tools` checks `tools`, `tool_choice` and `parallel_tool_calls` into a
`ToolRequest`. A forced choice ("required", or a named function) is met with structured
output: `forced_schema` is the JSON Schema the engine constrains the reply to, and
`forced_calls` / `forced_stream` read the constrained reply back as calls. With "auto" the
model decides, and the parser for its chat template's format (`TOOL_PARSERS`, picked by
`--tool-call-parser`) splits the reply into content and calls.

Each parser is one scanner, `scan(text, mode, final) -> (items, consumed, mode)`, that reads as
far as it can decide and returns what it decided: content pieces and complete calls. A whole
reply is one final scan; a stream scans the text it holds after each delta, emits what was
decided and keeps the rest. A call is emitted once its JSON has closed, its arguments in one
fragment: until then the text may still prove malformed (a reply cut by max_tokens, say), and
a malformed call stays content, which a stream could not take back once sent. Both paths run
the same scanner, so a stream reassembles to the whole parse (the tests check it over random
splits).

Why one file: the request checks, the forced grammar and the reply parsers are the one
concept of tool calling, and they share the call shapes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for

from pdserve.router import harmony
from pdserve.router.invalid_argument import BadParameter

logger = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
NO_PARAMETERS: Mapping[str, Any] = MappingProxyType({"type": "object", "properties": {}})
DEFS_KEYS = ("$defs", "definitions")  # where schemas keep the subschemas their $refs name

Item = str | tuple[str, str]  # a scanner's output: content text, or a call's (name, arguments)
Scanner = Callable[[str, str, bool], tuple[list[Item], int, str]]


def new_call_id() -> str:
    """OpenAI's shape: "call_" and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked."""

    tools: tuple[Mapping[str, Any], ...]  # as sent: the chat template's `tools=`
    schemas: Mapping[str, Mapping[str, Any]]  # function name -> its parameters' JSON Schema
    choice: str  # "none" | "auto" | "required" | "function" (a named function)
    function: str | None  # the function a named tool_choice forces
    parallel_tool_calls: bool


def finish_reason(reason: str, has_calls: bool) -> str:
    """OpenAI's finish_reason for a reply: "tool_calls" when it called a function and ended by
    itself; "length" stays, so a client learns that the reply was cut short."""
    return "tool_calls" if has_calls and reason == "stop" else reason


# ---------------------------------------------------------------- the request's tools


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it has none (`tools: []` counts as none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadParameter("parallel_tool_calls", "parallel_tool_calls: must be a boolean")
    if tools is None or (isinstance(tools, list) and not tools):
        if choice not in (None, "none"):
            raise BadParameter("tool_choice", 'tool_choice: only "none" is allowed without tools')
        return None
    if not isinstance(tools, list):
        raise BadParameter("tools", 'tools: must be a list of {"type": "function", ...}')
    if len(tools) > MAX_TOOLS:
        raise BadParameter("tools", f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    schemas: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        name, schema = _tool(i, tool)
        if name in schemas:
            raise BadParameter("tools", f"tools[{i}].function.name: {name!r} is declared twice")
        schemas[name] = schema
    kind, function = _choice(choice, schemas)
    if kind == "required":
        _merged_defs(schemas)  # refused now rather than when the grammar is built
    return ToolRequest(tuple(tools), MappingProxyType(schemas), kind, function,
                       parallel is not False)


def _tool(i: int, tool: Any) -> tuple[str, Mapping[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise BadParameter("tools", f'{where}: must be {{"type": "function", "function": {{...}}}}')
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise BadParameter("tools", f"{where}.function: must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadParameter("tools", f"{where}.function.name: must be 1 to 64 letters, digits, "
                                    "'_' or '-'")
    for key, kind in (("description", str), ("strict", bool)):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise BadParameter("tools", f"{where}.function.{key}: must be a {kind.__name__}")
    schema = function.get("parameters")
    if schema is None:
        return name, NO_PARAMETERS
    if not isinstance(schema, Mapping):
        raise BadParameter("tools", f"{where}.function.parameters: must be a JSON Schema object")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        at = "".join(f"[{p!r}]" for p in exc.path)
        raise BadParameter("tools", f"{where}.function.parameters{at}: not a valid JSON "
                                    f"Schema: {exc.message}") from None
    except RecursionError:  # the checker recurses per level: a 400, not a 500
        raise BadParameter("tools", f"{where}.function.parameters: nested too deeply") from None
    return name, schema


def _choice(choice: Any, schemas: Mapping[str, Any]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in CHOICES:
        return choice, None
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise BadParameter("tool_choice", 'tool_choice: must be "none", "auto", "required" or '
                                          '{"type": "function", "function": {"name": ...}}')
    if name not in schemas:
        raise BadParameter("tool_choice", f"tool_choice: function {name!r} is not among tools")
    return "function", name


# ---------------------------------------------------------------- forced choices


def forced_schema(req: ToolRequest) -> str | None:
    """The JSON Schema a forced choice constrains the reply to; None when the model is free.

    A named function: the reply is its arguments object. "required": an array of
    {"name", "parameters"} objects, one branch per tool. Each tool's `$defs` move to the root,
    where their `#/$defs/...` references resolve once the schema is nested.
    """
    if req.choice == "function":
        assert req.function is not None
        return json.dumps(dict(req.schemas[req.function]))
    if req.choice != "required":
        return None
    branches = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [name]},
                                "parameters": {k: v for k, v in schema.items()
                                               if k not in DEFS_KEYS}},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in req.schemas.items()]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update(_merged_defs(req.schemas))
    return json.dumps(schema)


def _merged_defs(schemas: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for schema in schemas.values():
        for key in DEFS_KEYS:
            for name, sub in (schema.get(key) or {}).items():
                if merged.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise BadParameter("tools", f"tools: two functions define {key} {name!r} "
                                                'differently, which tool_choice "required" '
                                                "cannot combine; rename one")
    return merged


def forced_calls(req: ToolRequest, text: str,
                 new_id: Callable[[], str] = new_call_id) -> list[ToolCall]:
    """The calls in the reply of a forced choice (its text, constrained by `forced_schema`)."""
    if req.choice == "function":
        assert req.function is not None
        return [ToolCall(new_id(), req.function, text)]
    if req.choice == "required":
        return RequiredToolParser.parse(text, new_id=new_id)[1]
    raise ValueError(f"tool_choice {req.choice!r} forces no call: parse its reply with the "
                     "TOOL_PARSERS parser, or not at all")


def forced_stream(req: ToolRequest, new_id: Callable[[], str] = new_call_id
                  ) -> NamedToolStream | RequiredToolParser:
    """The stream counterpart of `forced_calls`."""
    if req.choice == "function":
        assert req.function is not None
        return NamedToolStream(req.function, new_id)
    if req.choice == "required":
        return RequiredToolParser(new_id=new_id)
    raise ValueError(f"tool_choice {req.choice!r} forces no call")


# ---------------------------------------------------------------- streams


def _header_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def _arguments_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class ToolParser:
    """One reply's text -> content and tool calls: whole (`parse`) or streamed (`feed` each
    text delta, then `finish`) as OpenAI chat-completion-chunk `delta` dicts. A subclass is
    one format: its `scan`. Without parallel tool calls, calls after the first are dropped.
    """

    scan: Scanner

    def __init__(self, parallel_tool_calls: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._held = ""  # the text not decided yet
        self._mode = "start"
        self._parallel = parallel_tool_calls
        self._new_id = new_id
        self.num_calls = 0

    @classmethod
    def parse(cls, text: str, parallel_tool_calls: bool = True,
              new_id: Callable[[], str] = new_call_id) -> tuple[str | None, list[ToolCall]]:
        """The reply's content (None when empty) and calls."""
        items, _, _ = cls.scan(text, "start", True)
        calls = [ToolCall(new_id(), *item) for item in items if isinstance(item, tuple)]
        content = "".join(item for item in items if isinstance(item, str))
        return content or None, calls if parallel_tool_calls else calls[:1]

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._held += delta
        return self._emit(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """What the end of the reply decides (text held back as a possible call)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[dict[str, Any]]:
        items, consumed, self._mode = type(self).scan(self._held, self._mode, final)
        self._held = self._held[consumed:]
        deltas: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, str):
                if deltas and "content" in deltas[-1]:
                    deltas[-1]["content"] += item
                else:
                    deltas.append({"content": item})
            elif self._parallel or self.num_calls == 0:
                name, arguments = item
                deltas += [_header_delta(self.num_calls, self._new_id(), name),
                           _arguments_delta(self.num_calls, arguments)]
                self.num_calls += 1
        return deltas


class NamedToolStream:
    """A named tool_choice's reply, streamed as that function's arguments: the grammar makes
    the whole reply the arguments object, so each text delta is an arguments fragment."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_call_id) -> None:
        self._name, self._new_id = name, new_id
        self.num_calls = 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        deltas = self.finish()
        return (deltas + [_arguments_delta(0, delta)]) if delta else deltas

    def finish(self) -> list[dict[str, Any]]:
        if self.num_calls:
            return []
        self.num_calls = 1
        return [_header_delta(0, self._new_id(), self._name)]


# ---------------------------------------------------------------- scanners


def _call(obj: Any, *keys: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, its arguments under the first of `keys`
    present; None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in keys if obj.get(k) is not None), {})
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _overlap(text: str, marker: str) -> int:
    """How many of text's last characters could begin `marker` (held until known)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _add_run(items: list[Item], run: str, mode: str, boundary: str | None) -> str | None:
    """Adds a run of text between calls (`boundary` ends it: "call", "end", None when not yet
    known) to items. A blank run beside a call is dropped: the newlines around `<tool_call>`
    blocks are no content. Returns the new mode, or None when the run must wait."""
    if mode == "text" or (run and not run.isspace()):
        if run:
            items.append(run)
        return "text"
    if boundary is None:
        return None
    if boundary == "end" and mode == "start" and run:
        items.append(run)
    return mode


def _scan_hermes(text: str, mode: str, final: bool) -> tuple[list[Item], int, str]:
    """Hermes, Qwen2.5, Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    blocks, the text around them content; a block that does not parse stays content, and one
    the reply never closed (it stopped first) runs to the end. Modes: "start" / "call" (the
    text since the start / the last call is blank so far), "text" (it is not)."""
    items: list[Item] = []
    pos = search = 0  # pos: the current run of text starts here; search: look for blocks here
    while True:
        start = text.find(HERMES_OPEN, search)
        if start == -1:
            end = len(text) if final else max(search, len(text) - _overlap(text, HERMES_OPEN))
            new = _add_run(items, text[pos:end], mode, "end" if final else None)
            return (items, end, new) if new else (items, pos, mode)
        close = text.find(HERMES_CLOSE, start + len(HERMES_OPEN))
        if close == -1 and not final:
            new = _add_run(items, text[pos:start], mode, None)
            return (items, start, new) if new else (items, pos, mode)
        close = len(text) if close == -1 else close
        try:
            call = _call(json.loads(text[start + len(HERMES_OPEN):close]), "arguments")
        except (ValueError, RecursionError):  # deep nesting too: model output never raises
            call = None
        search = min(len(text), close + len(HERMES_CLOSE))
        if call is None:
            logger.debug("a <tool_call> block that is no call stays content")
            continue
        _add_run(items, text[pos:start], mode, "call")
        items.append(call)
        pos, mode = search, "call"


LLAMA_TAG = "<|python_tag|>"
LLAMA_SEPARATORS = " \t\r\n;"
_DECODER = json.JSONDecoder()


def _scan_llama3(text: str, mode: str, final: bool) -> tuple[list[Item], int, str]:
    """Llama 3.1/3.2 JSON: a reply that is, after an optional `<|python_tag|>`, call objects
    `{"name": ..., "parameters": {...}}` ("arguments" too) separated by ";". A reply that does
    not start with a call is all content; text after the calls that is not a call is content.
    Modes: "start", "calls" (after a call), "text" (the rest is content)."""
    if mode == "text":
        return ([text] if text else []), len(text), mode
    items: list[Item] = []
    pos = 0
    while True:
        if mode == "start":
            head = text.lstrip()
            body = head.removeprefix(LLAMA_TAG).lstrip()
            if not final and (LLAMA_TAG.startswith(head) or not body):
                return items, 0, mode  # blank, or the tag so far: could still be a call
            at = len(text) - len(body)
        else:
            at = len(text) - len(text[pos:].lstrip(LLAMA_SEPARATORS))
            if at == len(text):
                return items, (len(text) if final else pos), mode
        call, end = None, -1
        if text.startswith("{", at):
            try:
                obj, end = _DECODER.raw_decode(text, at)
                call = _call(obj, "parameters", "arguments")
            except (ValueError, RecursionError):
                if not final:
                    return items, pos, mode  # an object still open (or malformed: known at end)
        if call is None:  # the rest is content: the whole reply when no call came first
            logger.debug("llama3_json: text that is no call stays content")
            rest = text[0 if mode == "start" else at:]
            items += [rest] if rest else []
            return items, len(text), "text"
        items.append(call)
        pos, mode = end, "calls"


def _scan_required(text: str, mode: str, final: bool) -> tuple[list[Item], int, str]:
    """tool_choice "required", the reply constrained to `[{"name": ..., "parameters": {...}},
    ...]`: no content, and a reply cut short keeps the calls that closed. Modes: "start"
    (before "["), "calls" (inside it), "done"."""
    items: list[Item] = []
    pos = 0
    while mode != "done":
        at = len(text) - len(text[pos:].lstrip(" \t\r\n" if mode == "start" else " \t\r\n,"))
        if at == len(text):
            return items, (len(text) if final else pos), mode
        if mode == "start":
            pos, mode = (at + 1, "calls") if text[at] == "[" else (at, "done")
            continue
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            if not final and text[at] == "{":
                return items, pos, mode
            break
        call = _call(obj, "parameters")
        if call is None:
            break
        items.append(call)
        pos = end
    return items, len(text), "done"


def _scan_openai(text: str, mode: str, final: bool) -> tuple[list[Item], int, str]:
    """gpt-oss's calls, which router.harmony frames in the content as
    `<|start|>functions.NAME<|message|>ARGUMENTS<|call|>` (`--reasoning-parser openai_gptoss`
    reads the harmony reply first); the text around them is content. Arguments that are not
    a JSON object leave the call's text as content. One mode ("start"): the frames carry no
    state across scans."""
    items: list[Item] = []
    pos = 0
    while True:
        start = text.find(harmony.CALL_OPEN, pos)
        if start == -1:
            end = len(text) if final else len(text) - _overlap(text[pos:], harmony.CALL_OPEN)
            items += [text[pos:end]] if end > pos else []
            return items, end, mode
        items += [text[pos:start]] if start > pos else []
        close = text.find(harmony.CALL_CLOSE, start)
        if close == -1:  # harmony closes every frame it opens, at the latest when the reply ends
            return items, start, mode
        name, _, arguments = text[start + len(harmony.CALL_OPEN):close].partition(
            harmony.MESSAGE)
        call = None
        with contextlib.suppress(ValueError, RecursionError):  # model output never raises
            call = _call({"name": name.removeprefix("functions."),
                          "arguments": json.loads(arguments)}, "arguments")
        if call is None:
            logger.debug("openai: a call whose arguments are no JSON object stays content")
            items.append(arguments)
        else:
            items.append(call)
        pos = close + len(harmony.CALL_CLOSE)


class HermesToolParser(ToolParser):
    scan = staticmethod(_scan_hermes)


class Llama3JsonToolParser(ToolParser):
    scan = staticmethod(_scan_llama3)


class RequiredToolParser(ToolParser):
    scan = staticmethod(_scan_required)


class OpenAIToolParser(ToolParser):
    scan = staticmethod(_scan_openai)


TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType(
    {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
     "openai": OpenAIToolParser})


def read_reply(req: ToolRequest, parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content and calls: a forced choice's constrained output, or the
    `parser`'s format (auto)."""
    if req.choice in ("required", "function"):
        return None, forced_calls(req, text)
    return TOOL_PARSERS[parser].parse(text, req.parallel_tool_calls)


def reply_stream(req: ToolRequest, parser: str) -> ToolParser | NamedToolStream:
    """`read_reply`'s streaming twin: feed it the text deltas, then finish it."""
    if req.choice in ("required", "function"):
        return forced_stream(req)
    return TOOL_PARSERS[parser](req.parallel_tool_calls)
