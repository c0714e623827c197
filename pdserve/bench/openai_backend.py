"""`pdserve bench --backend openai`: the same workloads against any OpenAI-compatible server.

Requests go to `/v1/completions` with token-id prompts, `stream: true` and
`stream_options.include_usage` (what `vllm bench serve` sends too), `ignore_eos` (a vLLM
extension pdserve shares) so every request generates exactly its output length, and the job's
session id as `session_id` (pdserve's affinity field; other servers ignore it).

Streamed text carries no token ids, so, as `vllm bench serve` does, every chunk with text
counts as one token and the last one takes what the final usage adds (tokens whose text was
held back, e.g. half a UTF-8 character). A later turn of a session continues from the answer's
text re-tokenized with the model's tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.bench.trace import RequestRecord
from pdserve.bench.workloads import BenchRequest
from pdserve.client.rpc import ClientTLS


@dataclass(frozen=True)
class ServedModel:
    name: str
    vocab_size: int


class OpenAIBackend:
    """Sends bench turns to `base_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(self, base_url: str, tokenizer: Any, api_key: str | None = None,
                 model: str | None = None, tls: ClientTLS | None = None) -> None:
        self.base_url, self.tokenizer, self.model = base_url.rstrip("/"), tokenizer, model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        verify = tls.ssl_context() if tls is not None else True
        self.http = httpx.AsyncClient(headers=headers, timeout=None, verify=verify,
                                      limits=httpx.Limits(max_connections=None,
                                                          max_keepalive_connections=None))

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def wait_ready(self, timeout: float,
                         alive: Callable[[], bool] = lambda: True) -> ServedModel:
        """Poll /models until the server answers (or `alive()` says it never will); the model
        the bench will ask for."""
        end = time.monotonic() + timeout
        while True:
            if not alive():
                raise RuntimeError(f"the server behind {self.base_url} exited")
            try:
                reply = await self.http.get(f"{self.base_url}/models", timeout=5)
                if reply.status_code == 200:
                    served = [m["id"] for m in reply.json()["data"]]
                    name = self.model or served[0]
                    if name not in served:
                        raise ValueError(f"model: {name!r} is not served; it serves {served}")
                    return ServedModel(name, len(self.tokenizer))
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{self.base_url}/models did not answer in {timeout} s")
            await asyncio.sleep(0.5)

    async def send(self, request_id: str, turn: BenchRequest, prompt: list[int], t0: float,
                   temperature: float, timeout_s: float) -> tuple[RequestRecord, list[int]]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": turn.output_len,
                "temperature": temperature, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        if turn.session_id:
            body["session_id"] = turn.session_id
        times: list[float] = []
        text: list[str] = []
        usage: dict[str, Any] = {}
        error = None
        sent = time.perf_counter() - t0
        try:
            await asyncio.wait_for(self._stream(body, t0, times, text, usage), timeout_s)
        except (TimeoutError, httpx.HTTPError, _Failed) as exc:
            error = str(exc) if isinstance(exc, _Failed) else type(exc).__name__
        counts = [1] * len(times)
        completion = usage.get("completion_tokens", len(times))
        if counts and completion > len(times):
            counts[-1] += completion - len(times)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        record = RequestRecord(
            request_id=request_id, start=sent, end=time.perf_counter() - t0,
            chunk_times=tuple(times), chunk_tokens=tuple(counts), num_prompt_tokens=len(prompt),
            error=error, cached_tokens=cached, session_id=turn.session_id,
        )
        if not turn.session_id:  # only a session's next turn needs the answer's tokens
            return record, []
        output = self.tokenizer("".join(text), add_special_tokens=False).input_ids
        return record, list(output)

    async def _stream(self, body: dict[str, Any], t0: float, times: list[float],
                      text: list[str], usage: dict[str, Any]) -> None:
        async with self.http.stream("POST", f"{self.base_url}/completions", json=body) as reply:
            if reply.status_code != 200:
                raise _Failed(f"HTTP_{reply.status_code}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise _Failed(str(chunk["error"].get("code") or "STREAM_ERROR").upper())
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    times.append(time.perf_counter() - t0)
                    text.append(choices[0]["text"])
                usage.update(chunk.get("usage") or {})


class _Failed(Exception):
    """The server refused or broke off the request (the code is what the record keeps)."""
