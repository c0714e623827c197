"""Coalescing under back-pressure, end to end: a client that stops reading gets the backlog in
fewer, larger messages, with nothing reordered, dropped or repeated, and text == decode(ids).

The real Router + RouterServer + OpenAI front run in this process on a real socket; the
decode worker is benchmarks.synthetic_decode's (a real authenticated gRPC server whose step s
emits the word token token_ids[s % len]), stepping every millisecond. The gRPC client shrinks
its HTTP/2 window (no BDP growth); the HTTP client shrinks its receive buffer and the server
socket its send buffer, so a pause in reading pushes back on the router within a few hundred
tokens.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import pytest

from benchmarks.synthetic_decode import StepTokens, start_worker
from pdserve.cluster_secret import ClusterSecret
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

MAX_TOKENS = 1500
PAUSE_S = 1.5
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def worker(tokenizer):
    secret = ClusterSecret.generate()
    vocab = StepTokens(tokenizer)
    child = start_worker(secret, vocab.token_ids, step_ms=1.0)
    yield secret, child.info["address"], vocab
    child.stop()


async def _serve(smollm2_dir, secret, address):
    from pdserve.router.config import RouterConfig
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.openai.app import OpenAIApp
    from pdserve.router.openai.server import HTTPServer
    from pdserve.router.router import Router
    from pdserve.router.server import RouterServer
    from pdserve.router.validation import ModelContext

    model = await asyncio.to_thread(ModelContext.load, str(smollm2_dir), "smollm2")
    router = Router(model, RouterConfig(colocated=True), RouterMetrics(), secret=secret)
    await router.add_worker("decode-0", "decode", address)
    server = RouterServer(router, "127.0.0.1", 0)
    await router.wait_ready(timeout=30)
    await server.start()
    front = HTTPServer(OpenAIApp(router, server.can_serve).app, "127.0.0.1", 0)
    # accepted connections inherit it: a small, fixed send buffer (no autotuning to MBs)
    front.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    await front.start()
    return server, front


def _check_in_order(token_ids: list[int], vocab: StepTokens, tokenizer, text: str) -> None:
    """Every token is the step after the one before it (none dropped, repeated or swapped),
    all MAX_TOKENS of them, and the text is exactly their decode."""
    assert len(token_ids) == MAX_TOKENS
    steps = [vocab.by_id[t] for t in token_ids]
    n = len(vocab.token_ids)
    assert all((b - a) % n == 1 for a, b in zip(steps, steps[1:], strict=False))
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)


def test_a_paused_grpc_reader_gets_merged_messages_in_order(smollm2_dir, worker, tokenizer):
    secret, address, vocab = worker

    async def main():
        server, front = await _serve(smollm2_dir, secret, address)
        try:
            async with grpc.aio.insecure_channel(server.address, options=SMALL_WINDOW) as ch:
                call = pdserve_pb2_grpc.InferenceStub(ch).Generate(pdserve_pb2.GenerateRequest(
                    request_id="slow", prompt_token_ids=vocab.token_ids[:8],
                    sampling=pdserve_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                        ignore_eos=True)))
                first = await call.read()
                await asyncio.sleep(PAUSE_S)  # stop reading: the window fills, writes wait
                messages = [first]
                while (message := await call.read()) is not grpc.aio.EOF:
                    messages.append(message)
        finally:
            await front.stop()
            await server.stop(grace=0)
        return messages

    messages = asyncio.run(main())
    token_ids = [t for m in messages for t in m.token_ids]
    _check_in_order(token_ids, vocab, tokenizer, "".join(m.text for m in messages))
    assert messages[-1].finish_reason == "length"
    assert len(messages[0].token_ids) == 1  # the first token is never held back
    assert len(messages) < MAX_TOKENS / 2  # the backlog went out merged


def test_a_paused_http_reader_gets_merged_events_in_order(smollm2_dir, worker, tokenizer):
    secret, address, vocab = worker

    async def main():
        server, front = await _serve(smollm2_dir, secret, address)
        try:
            return await asyncio.to_thread(_slow_sse, front.port, vocab.token_ids[:8])
        finally:
            await front.stop()
            await server.stop(grace=0)

    events = asyncio.run(main())
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    words = text.split()
    assert len(words) == MAX_TOKENS
    token_ids = [vocab.token_ids[vocab.by_word[w]] for w in words]
    _check_in_order(token_ids, vocab, tokenizer, text)
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(chunks) < MAX_TOKENS / 2


def _slow_sse(port: int, prompt: list[int]) -> list[str]:
    """POST a streamed completion over a socket with a small receive buffer, stop reading for
    PAUSE_S after the first bytes, then read to the end; the SSE data payloads."""
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(60)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                     b"content-type: application/json\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = sock.recv(256)
        time.sleep(PAUSE_S)
        while chunk := sock.recv(65536):
            data += chunk
    head, _, raw = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    payload = _dechunk(raw) if b"chunked" in head.lower() else raw
    return [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]


def _dechunk(raw: bytes) -> bytes:
    out, rest = b"", raw
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out
