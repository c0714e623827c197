"""The router's GenerateResponse messages -> OpenAI's JSON: whole answers and stream chunks.

`Choices` follows every choice of one OpenAI request as its messages arrive and builds both
shapes from them, so a streamed answer and a whole one carry the same text, tokens, logprobs
and usage (usage counts each prompt once, whatever `n`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.proto import pdserve_pb2
from pdserve.router.openai.protocol import OpenAIRequest
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


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: pdserve_pb2.Usage | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # chat entries
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the router read them
    content: str | None = None  # the text outside the calls, when there are calls
    reader: ToolParser | NamedToolStream | None = None  # a streamed chat with tools
    started: bool = False  # its first message is in
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when asked
    echoed: tuple[int, ...] | None = None  # echo: prompt tokens whose logprobs lead the next
    echo_entries: list[pdserve_pb2.TokenLogprob] = field(default_factory=list)
    completion_logprobs: dict[str, list] = field(default_factory=lambda: {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})


class Choices:
    def __init__(self, request: OpenAIRequest, model: str, texts: TokenTexts,
                 tool_call_parser: str = "hermes",
                 prompt_token_ids: list[tuple[int, ...]] | None = None) -> None:
        """`prompt_token_ids`: each prompt's, as validated (echo and prompt logprobs)."""
        self.request, self.model, self.texts = request, model, texts
        self.tool_call_parser = tool_call_parser
        self.prompt_token_ids = prompt_token_ids or []
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

    def tool_chunks(self, index: int, message: pdserve_pb2.GenerateResponse
                    ) -> list[dict[str, Any]]:
        """A chat with tools: the message's text through the choice's tool-call reader, as
        OpenAI streams calls (`delta.tool_calls`), the finish in a chunk of its own."""
        choice = self.choices[index]
        self._open(index, message)
        self._record(index, message)
        if choice.reader is None:
            choice.reader = reply_stream(self.request.tools, self.tool_call_parser)
        deltas = choice.reader.feed(message.text) if message.text else []
        if message.finish_reason:
            deltas += choice.reader.finish()
        chunks = [self._chunk([{"index": index, "delta": delta, "logprobs": None,
                                "finish_reason": None}]) for delta in deltas]
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
                entry["message"] = {"role": "assistant", "content": c.text}
                if c.tool_calls:
                    entry["message"] = {"role": "assistant", "content": c.content,
                                        "tool_calls": c.tool_calls}
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
