"""The client side of benchmarks/router_throughput.py: closed-loop streams over gRPC or HTTP.

Each of `streams` streams sends a request, reads it to its end, and sends the next until the
phase's duration is over; `Recorder` keeps every token's receive time and step index (the
synthetic decode worker's token says which step produced it), each request's TTFT and outcome.
gRPC: grpc.aio, 4 streams per connection (a connection of its own per channel), a fixed
16 KiB HTTP/2 window per stream. HTTP: httpx SSE to /v1/completions, a connection per stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass


class Recorder:
    """Every streamed token's receive time and step index, and each request's outcome."""

    def __init__(self) -> None:
        self.recv_times: list[float] = []
        self.token_index: list[int] = []
        self.messages = 0  # messages (gRPC) or events (SSE) that carried tokens
        self.ttft: list[float] = []  # request sent -> its first token received, seconds
        self.outcomes: Counter[str] = Counter()  # "<tokens> <finish_reason>" -> requests
        self.errors: Counter[str] = Counter()

    def tokens(self, now: float, indexes: list[int]) -> None:
        self.messages += bool(indexes)
        self.recv_times.extend([now] * len(indexes))
        self.token_index.extend(indexes)

    def finished(self, num_tokens: int, reason: str) -> None:
        self.outcomes[f"{num_tokens} {reason or '-'}"] += 1


@dataclass(frozen=True)
class Load:
    front: str  # "grpc" | "http"
    streams: int
    max_tokens: int
    prompt: tuple[int, ...]
    duration_s: float


STREAMS_PER_CONNECTION = 4  # the gRPC client's streams share connections, this many each
# a fixed 16 KiB HTTP/2 window per stream: with BDP probing a client slower than the router
# lets its window grow to megabytes and buffers seconds of tokens in it, so the router never
# sees that the client fell behind (and this 2-core machine's client is slower than the router)
CLIENT_WINDOW = [("grpc.http2.lookahead_bytes", 16384), ("grpc.http2.bdp_probe", 0)]


async def grpc_load(load: Load, address: str, index: dict[int, int], rec: Recorder) -> None:
    import grpc

    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

    # a connection of its own per channel (no shared subchannel): the kernel spreads
    # connections, not streams, over router processes
    options = [("grpc.use_local_subchannel_pool", 1), *CLIENT_WINDOW]
    channels = [grpc.aio.insecure_channel(address, options=options)
                for _ in range(-(-load.streams // STREAMS_PER_CONNECTION))]
    stubs = [pdserve_pb2_grpc.InferenceStub(c) for c in channels]
    sampling = pdserve_pb2.SamplingParams(max_tokens=load.max_tokens, temperature=0,
                                          ignore_eos=True)
    end = time.monotonic() + load.duration_s

    async def stream(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            request = pdserve_pb2.GenerateRequest(request_id=f"s{i}-{n}", sampling=sampling,
                                                  prompt_token_ids=load.prompt)
            n, got, reason, sent = n + 1, 0, "", time.monotonic()
            try:
                async for msg in stubs[i % len(stubs)].Generate(request):
                    now = time.monotonic()
                    if not got:
                        rec.ttft.append(now - sent)
                    rec.tokens(now, [index[t] for t in msg.token_ids])
                    got, reason = got + len(msg.token_ids), msg.finish_reason or reason
            except grpc.aio.AioRpcError as exc:
                rec.errors[exc.code().name] += 1
                continue
            rec.finished(got, reason)

    try:
        await asyncio.gather(*(stream(i) for i in range(load.streams)))
    finally:
        for channel in channels:
            await channel.close()


async def http_load(load: Load, url: str, words: dict[str, int], rec: Recorder) -> None:
    import httpx

    body = {"prompt": list(load.prompt), "max_tokens": load.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    end = time.monotonic() + load.duration_s
    limits = httpx.Limits(max_connections=load.streams, max_keepalive_connections=load.streams)

    async def request(client: httpx.AsyncClient, url: str) -> None:
        got, reason, usage, sent = 0, "", -1, time.monotonic()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                rec.errors[f"HTTP {response.status_code}"] += 1
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now, chunk = time.monotonic(), json.loads(line[6:])
                for choice in chunk["choices"]:
                    indexes = [words[w] for w in choice["text"].split()]
                    if indexes and not got:
                        rec.ttft.append(now - sent)
                    rec.tokens(now, indexes)
                    got, reason = got + len(indexes), choice["finish_reason"] or reason
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        if usage != got:
            rec.errors["usage.completion_tokens != tokens streamed"] += 1
        rec.finished(got, reason)

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        while time.monotonic() < end:
            try:
                await request(client, url)
            except httpx.HTTPError as exc:
                rec.errors[f"{type(exc).__name__}: {exc}"[:100]] += 1

    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        await asyncio.gather(*(stream(client, i) for i in range(load.streams)))


