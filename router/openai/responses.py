"""The router's GenerateResponse messages -> OpenAI's JSON: whole answers and stream chunks.

`Choices` follows every choice of one OpenAI request as its messages arrive and builds both
shapes from them, so a streamed answer and a whole one carry the same text, tokens, logprobs
and usage (usage counts each prompt once, whatever `n`). A whole chat answer's reasoning and
tool calls are the router's reading of the reply (its last message); a stream reads them as it
goes, with the same scanners (router.reasoning, router.tools).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.openai.protocol import OpenAIRequest
from pdserve.router.reasoning import ReasoningStream
from pdserve.router.tools import NamedToolStream, ToolParser, reply_stream

_MARK = "\x00"  # where a template's text goes (json.dumps writes it as \u0000, once)


def dumps(value: Any) -> str:
    """Compact JSON, as the HTTP front sends it."""
    return json.dumps(value, separators=(",", ":"))


class TokenTexts:
    """Token id -> its text, as logprobs show it (decoded alone), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


class ReplyReader:
    """One streamed chat reply's text deltas -> OpenAI `delta` dicts: its reasoning split off
    first (`reasoning`: None when the request has no reasoning mode), the rest through the
    tool-call reader (`tools`: None when the request has no tools), as content otherwise."""

    def __init__(self, reasoning: ReasoningStream | None,
                 tools: ToolParser | NamedToolStream | None, include_reasoning: bool) -> None:
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(*(self.reasoning.feed(text) if self.reasoning else ("", text)))

    def finish(self) -> list[dict[str, Any]]:
        deltas = self._deltas(*(self.reasoning.finish() if self.reasoning else ("", "")))
        return deltas + (self.tools.finish() if self.tools else [])

    @property
    def plain(self) -> bool:
        """What follows is plain content: a stream may send it as any text delta."""
        return self.tools is None and (self.reasoning is None or self.reasoning.answering)

    def _deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        delta = {"reasoning_content": reasoning} if reasoning and self.include_reasoning else {}
        if content and self.tools is not None:
            return ([delta] if delta else []) + self.tools.feed(content)
        if content:
            delta["content"] = content
        return [delta] if delta else []


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: pdserve_pb2.Usage | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat entries
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the router read them
    content: str | None = None  # the answer: outside the calls, after the reasoning
    reasoning: str | None = None  # the router split the reply (its reasoning, "": none)
    reader: ReplyReader | None = None  # a streamed chat read for reasoning or tool calls
    started: bool = False  # its first message is in
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked
    echoed: tuple[int, ...] | None = None  # echo: prompt tokens whose logprobs lead the next
    echo_entries: list[pdserve_pb2.TokenLogprob] = field(default_factory=list)
    completion_logprobs: dict[str, list] = field(default_factory=lambda: {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})


class Choices:
    def __init__(self, request: OpenAIRequest, model: str, texts: TokenTexts,
                 tool_call_parser: str = "hermes",
                 prompt_token_ids: list[tuple[int, ...]] | None = None,
                 reasoning_parser: str | None = None,
                 reasoning_modes: list[str | None] | None = None) -> None:
        """`prompt_token_ids`: each prompt's, as validated (echo and prompt logprobs);
        `reasoning_parser`: the server's (chat answers then carry `reasoning_content`);
        `reasoning_modes`: each prompt's, as validated (None: its reasoning is not split)."""
        self.request, self.model, self.texts = request, model, texts
        self.tool_call_parser = tool_call_parser
        self.prompt_token_ids = prompt_token_ids or []
        self.reasoning_modes = reasoning_modes or [None] * len(request.requests)
        self.show_reasoning = (request.chat and reasoning_parser is not None
                               and request.include_reasoning)
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(len(request.requests) * request.n)]
        self._templates: dict[int, tuple[str, str]] = {}  # add_json's, per choice

    # ---- one message in, the chunk it makes ----

    def add(self, index: int, message: pdserve_pb2.GenerateResponse) -> dict[str, Any] | None:
        """Record a message of choice `index`; the stream chunk for it (None: nothing new)."""
        self._open(index, message)
        new_logprobs = self._record(index, message)
        if not (message.text or message.token_ids or message.finish_reason):
            return None
        return self._chunk([self._chunk_choice(index, message, new_logprobs)])

    def reads(self, index: int) -> bool:
        """Whether choice `index` streams through `read_chunks` (its reply is read for
        reasoning or tool calls, and may still hold some) rather than as plain text."""
        reader = self.choices[index].reader
        if reader is not None:
            return not reader.plain
        return self.request.tools is not None or self._mode(index) is not None

    def read_chunks(self, index: int, message: pdserve_pb2.GenerateResponse
                    ) -> list[dict[str, Any]]:
        """The message's text through the choice's reader: reasoning as
        `delta.reasoning_content`, calls as OpenAI streams them (`delta.tool_calls`), the
        rest as `delta.content`; its logprobs on the first chunk; the finish in a chunk of
        its own."""
        choice = self.choices[index]
        self._open(index, message)
        logprobs = self._record(index, message)
        if choice.reader is None:
            mode = self._mode(index)
            tools = self.request.tools
            choice.reader = ReplyReader(
                ReasoningStream(mode) if mode is not None else None,
                reply_stream(tools, self.tool_call_parser) if tools is not None else None,
                self.show_reasoning)
        deltas = choice.reader.feed(message.text) if message.text else []
        if message.finish_reason:
            deltas += choice.reader.finish()
        if logprobs is not None and message.token_ids and not deltas:
            deltas = [{}]  # the text is held back, its tokens' logprobs are not
        chunks = [self._chunk([{"index": index, "delta": delta,
                                "logprobs": logprobs if i == 0 else None,
                                "finish_reason": None}]) for i, delta in enumerate(deltas)]
        if message.finish_reason:
            chunks.append(self._chunk([self._chunk_choice(index, message, None)]))
            chunks[-1]["choices"][0]["delta"] = {}
        return chunks

    def add_json(self, index: int, message: pdserve_pb2.GenerateResponse) -> str | None:
        """`add`, with the chunk as the JSON text a stream sends. A plain text delta (no
        logprobs, not the last: nearly every chunk) comes from a template of that same chunk,
        not through a dict and a whole json.dumps: the per-token cost of the HTTP front."""
        if (self.request.logprobs is not None or message.finish_reason
                or not self.choices[index].started):
            chunk = self.add(index, message)
            return None if chunk is None else dumps(chunk)
        self._record(index, message)
        if not (message.text or message.token_ids):
            return None
        template = self._templates.get(index)
        if template is None:  # the chunk `add` makes, its text marked (the mark is last)
            entry: dict[str, Any] = {"index": index, "finish_reason": None}
            entry.update({"delta": {"content": _MARK}} if self.request.chat else {"text": _MARK})
            entry["logprobs"] = None
            head, tail = dumps(self._chunk([entry])).rsplit(dumps(_MARK), 1)
            template = self._templates[index] = (head, tail)
        return dumps(message.text).join(template)

    def _open(self, index: int, message: pdserve_pb2.GenerateResponse) -> None:
        """A choice's first message: its prompt logprobs when asked and, with echo, the
        prompt ahead of its text (and of its logprobs)."""
        choice = self.choices[index]
        if choice.started:
            return
        choice.started = True
        asked = self.request.prompt_logprobs
        if asked is not None:
            choice.prompt_logprobs = [None] + [self._prompt_entry(lp, asked)
                                               for lp in message.prompt_logprobs]
        if not self.request.echo:
            return
        base = self.request.requests[index // self.request.n]
        prompt_ids = self.prompt_token_ids[index // self.request.n]
        message.text = (base.prompt if base.HasField("prompt")
                        else self.texts.tokenizer.decode(prompt_ids)) + message.text
        choice.echoed, choice.echo_entries = prompt_ids, list(message.prompt_logprobs)

    def _prompt_entry(self, lp: pdserve_pb2.TokenLogprob, n: int) -> dict[str, Any]:
        """vLLM's prompt logprobs at one position: the prompt token with its rank, then the
        top n best first (a prompt token among them takes its place and rank there)."""
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": self.texts(lp.token_id)}}
        for rank, top in enumerate(lp.top[:n], 1):
            entry[str(top.token_id)] = {"logprob": top.logprob, "rank": rank,
                                        "decoded_token": self.texts(top.token_id)}
        return entry

    def _record(self, index: int, message: pdserve_pb2.GenerateResponse) -> Any:
        """A message of choice `index` into its text, counts and end; its new logprobs."""
        choice = self.choices[index]
        offset = len(choice.text)
        choice.text += message.text
        choice.num_tokens += len(message.token_ids)
        new_logprobs = self._logprobs(choice, message, offset)
        if message.finish_reason:
            choice.tool_calls = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in message.tool_calls]
            choice.content = message.content or None
            if message.HasField("reasoning_content"):
                choice.reasoning = message.reasoning_content
            choice.finish_reason = message.finish_reason
            choice.stop_reason = self._stop_reason(index, message.stop_reason)
            choice.usage = message.usage
        return new_logprobs

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.request.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self.usage()}

    # ---- the whole answer ----

    def response(self) -> dict[str, Any]:
        kind = "chat.completion" if self.request.chat else "text_completion"
        choices = []
        for i, c in enumerate(self.choices):
            entry: dict[str, Any] = {"index": i, "finish_reason": c.finish_reason,
                                     "stop_reason": c.stop_reason}
            if self.request.chat:
                entry["message"] = self._message(c)
                entry["logprobs"] = ({"content": c.logprobs}
                                     if self.request.logprobs is not None else None)
            else:
                entry["text"] = c.text
                entry["logprobs"] = (c.completion_logprobs
                                     if self.request.logprobs is not None else None)
            if c.prompt_logprobs is not None and not self.request.chat:
                entry["prompt_logprobs"] = c.prompt_logprobs
            choices.append(entry)
        out = {"id": self.request.response_id, "object": kind, "created": self.created,
               "model": self.model, "choices": choices, "usage": self.usage()}
        if self.request.chat and self.choices[0].prompt_logprobs is not None:
            out["prompt_logprobs"] = self.choices[0].prompt_logprobs  # vLLM's place for chat
        return out

    def usage(self) -> dict[str, Any]:
        n = self.request.n
        prompt = sum(c.usage.prompt_tokens for c in self.choices[::n] if c.usage)
        cached = sum(c.usage.cached_tokens for c in self.choices[::n] if c.usage)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- helpers ----

    def _mode(self, index: int) -> str | None:
        return self.reasoning_modes[index // self.request.n]

    def _message(self, c: _Choice) -> dict[str, Any]:
        """A whole chat choice's message: the router's reading of the reply when it split
        off reasoning or read calls, else the reply's text."""
        if c.reasoning or c.tool_calls:
            content = c.content  # None when the reply is all reasoning, or all calls
        else:  # the router's answer when it split the reply (the same text, tags aside)
            content = c.text if c.reasoning is None else c.content or ""
        message: dict[str, Any] = {"role": "assistant"}
        if self.show_reasoning:
            message["reasoning_content"] = c.reasoning or None
        message["content"] = content
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        return message

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        return {"id": self.request.response_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def _chunk_choice(self, index: int, message: pdserve_pb2.GenerateResponse,
                      logprobs: Any) -> dict[str, Any]:
        finish = message.finish_reason or None
        entry: dict[str, Any] = {"index": index, "finish_reason": finish}
        if finish:
            entry["stop_reason"] = self._stop_reason(index, message.stop_reason)
        if self.request.chat:
            entry["delta"] = {"content": message.text} if message.text or not finish else {}
        else:
            entry["text"] = message.text
        entry["logprobs"] = logprobs
        choice = self.choices[index]
        if choice.prompt_logprobs is not None and not choice.num_tokens - len(message.token_ids):
            entry["prompt_logprobs"] = choice.prompt_logprobs  # on the choice's first chunk
        return entry

    def _logprobs(self, choice: _Choice, message: pdserve_pb2.GenerateResponse,
                  offset: int) -> Any:
        if self.request.logprobs is None:
            return None
        if self.request.chat:
            entries = [self._chat_entry(lp) for lp in message.logprobs]
            choice.logprobs.extend(entries)
            return {"content": entries}
        new = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if choice.echoed is not None:  # the echoed prompt's tokens first; the first has none
            for position, token_id in enumerate(choice.echoed):
                token = self.texts(token_id)
                lp = choice.echo_entries[position - 1] if position else None
                new["tokens"].append(token)
                new["token_logprobs"].append(lp.logprob if lp else None)
                new["top_logprobs"].append({self.texts(t.token_id): t.logprob
                                            for t in lp.top[:self.request.logprobs]}
                                           if lp else None)
                new["text_offset"].append(offset)
                offset += len(token)
            choice.echoed = None
        for lp in message.logprobs:
            token = self.texts(lp.token_id)
            new["tokens"].append(token)
            new["token_logprobs"].append(lp.logprob)
            new["top_logprobs"].append({self.texts(t.token_id): t.logprob for t in lp.top})
            new["text_offset"].append(offset)
            offset += len(token)
        for key, values in new.items():
            choice.completion_logprobs[key].extend(values)
        return new

    def _chat_entry(self, lp: pdserve_pb2.TokenLogprob) -> dict[str, Any]:
        token = self.texts(lp.token_id)
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (t := self.texts(top.token_id)),
                                  "logprob": top.logprob, "bytes": list(t.encode())}
                                 for top in lp.top]}

    def _stop_reason(self, index: int, value: str) -> str | int | None:
        """The stop string or stop token id that ended the choice; None for EOS (as vLLM).
        The router sends a token id as decimal text."""
        sampling = self.request.requests[index // self.request.n].sampling
        if not value:
            return None
        if value in sampling.stop or not value.isdigit():
            return value
        return int(value) if int(value) in sampling.stop_token_ids else None
