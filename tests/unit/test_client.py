"""Client / AsyncClient against an in-process fake Inference server (no router, no model).

The fake echoes the prompt one character per message (token id = ord(c)), fails on demand with
a status, and has a slow stream that records when the client cancels it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.client import AsyncClient, Client, GenerateChunk, PdserveError, Timings, Usage
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler_output import TokenLogprobs
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

ERRORS = {
    "bad": (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p must be in (0, 1], got 2.0"),
    "busy": (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 waiting)"),
}


@dataclass
class SlowEnd:
    """How one slow stream ended, as its servicer saw it."""

    cancelled: threading.Event = field(default_factory=threading.Event)  # is_active() False
    terminated: threading.Event = field(default_factory=threading.Event)  # callback fired


class FakeInference(pdserve_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.requests: list[pdserve_pb2.GenerateRequest] = []
        self._slow_ends: dict[str, SlowEnd] = {}  # by prompt: tests never share one
        self._lock = threading.Lock()

    def slow_end(self, prompt: str) -> SlowEnd:
        with self._lock:
            return self._slow_ends.setdefault(prompt, SlowEnd())

    def Generate(self, request, context):
        self.requests.append(request)
        request_id = request.request_id or "fake-1"
        if request.prompt in ERRORS:
            context.abort(*ERRORS[request.prompt])
        if request.prompt.startswith("slow"):
            yield from self._slow(request_id, context, self.slow_end(request.prompt))
            return
        text = (request.prompt or "".join(chr(t) for t in request.prompt_token_ids)
                or "".join(m.content for m in request.messages))
        if request.sampling.HasField("max_tokens"):
            text = text[: request.sampling.max_tokens]
        want_logprobs = request.sampling.HasField("logprobs")
        for i, c in enumerate(text):
            msg = pdserve_pb2.GenerateResponse(request_id=request_id, text=c, token_ids=[ord(c)])
            if want_logprobs:
                msg.logprobs.add(token_id=ord(c), logprob=-0.5).top.add(token_id=1, logprob=-1.0)
            if i == len(text) - 1:
                msg.finish_reason = "length"
                msg.usage.CopyFrom(pdserve_pb2.Usage(prompt_tokens=len(text),
                                                     completion_tokens=len(text),
                                                     cached_tokens=1))
                msg.timings.CopyFrom(pdserve_pb2.Timings(queue_s=0.1, ttft_s=0.2, e2e_s=0.3))
            yield msg

    def _slow(self, request_id, context, end: SlowEnd):
        """One chunk, then nothing for 10 s: ending sooner means the client cancelled it."""
        context.add_callback(end.terminated.set)
        try:
            yield pdserve_pb2.GenerateResponse(request_id=request_id, text="a", token_ids=[97])
            give_up = time.monotonic() + 10.0
            while context.is_active() and time.monotonic() < give_up:
                time.sleep(0.01)
        finally:
            # A cancel that lands while the first chunk is still being sent makes the server
            # drop this generator at the yield instead of resuming it: check here, not above.
            if not context.is_active():
                end.cancelled.set()

    def Abort(self, request, context):
        return pdserve_pb2.AbortResponse(found=request.request_id == "known")

    def GetModelInfo(self, request, context):
        return pdserve_pb2.ModelInfo(model="fake", max_model_len=64, vocab_size=256,
                                     block_size=16, dtype="float32", eos_token_ids=[0])

    def GetStats(self, request, context):
        worker = pdserve_pb2.WorkerStats(worker_id="d0", role="decode", up=True, num_blocks=8)
        return pdserve_pb2.Stats(workers=[worker], num_queued=2, num_inflight=1)


@pytest.fixture(scope="module")
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    fake, health_servicer = FakeInference(), health.HealthServicer()
    pdserve_pb2_grpc.add_InferenceServicer_to_server(fake, srv)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", fake, health_servicer
    srv.stop(0)


@pytest.fixture
def address(server):
    address, fake, health_servicer = server
    fake.__init__()  # fresh records per test
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return address


@pytest.fixture
def fake(server, address) -> FakeInference:
    return server[1]


@pytest.fixture
def client(address):
    with Client(address) as c:
        yield c


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# ---- sync Client ----------------------------------------------------------------------------


def test_generate_streams_one_chunk_per_character(client):
    chunks = list(client.generate("hi!", request_id="r1"))
    assert [c.text for c in chunks] == ["h", "i", "!"]
    assert [c.token_ids for c in chunks] == [(104,), (105,), (33,)]
    assert all(c.request_id == "r1" for c in chunks)
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[0].usage is None and chunks[0].timings is None
    assert chunks[-1].usage == Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=1)
    assert chunks[-1].timings == Timings(queue_s=0.1, ttft_s=0.2, e2e_s=0.3)
    assert chunks[-1].stop_reason is None
    with pytest.raises(AttributeError):
        chunks[0].text = "x"  # frozen


def test_complete_joins_the_stream(client):
    out = client.complete([104, 105], sampling=SamplingParams(max_tokens=5, logprobs=1))
    assert (out.text, out.token_ids, out.finish_reason) == ("hi", (104, 105), "length")
    assert out.request_id == "fake-1"
    assert out.usage == Usage(2, 2, 1) and out.timings == Timings(0.1, 0.2, 0.3)
    assert out.logprobs == (TokenLogprobs(104, -0.5, ((1, -1.0),)),
                            TokenLogprobs(105, -0.5, ((1, -1.0),)))


def test_sampling_none_leaves_the_field_unset(client, fake):
    client.complete("ab")
    assert not fake.requests[-1].HasField("sampling")


def test_sampling_is_sent_in_full(client, fake):
    params = SamplingParams(max_tokens=1, temperature=0.0, top_p=0.9, top_k=5, seed=7,
                            stop=("x",), stop_token_ids=(3,), logprobs=2, ignore_eos=True)
    assert client.complete("ab").text == "ab"
    assert client.complete("ab", sampling=params).text == "a"
    sent = fake.requests[-1]
    assert sent.HasField("sampling") and sent.sampling.HasField("temperature")
    s = sent.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.logprobs) == (
        1, 0.0, pytest.approx(0.9), 5, 7, 2)
    assert (list(s.stop), list(s.stop_token_ids), s.ignore_eos) == (["x"], [3], True)


def test_request_fields(client, fake):
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "brief"}]
    assert client.complete(messages=messages, session_id="s1", model="m").text == "bebrief"
    sent = fake.requests[-1]
    assert [(m.role, m.content) for m in sent.messages] == [("system", "be"), ("user", "brief")]
    assert (sent.session_id, sent.model, sent.HasField("prompt")) == ("s1", "m", False)
    with pytest.raises(ValueError, match="exactly one"):
        client.generate("a", messages=messages)
    with pytest.raises(ValueError, match="exactly one"):
        client.generate()


@pytest.mark.parametrize("prompt", sorted(ERRORS))
def test_status_surfaces_as_pdserve_error(client, prompt):
    code, message = ERRORS[prompt]
    with pytest.raises(PdserveError) as info:
        client.complete(prompt)
    assert (info.value.code, info.value.message) == (code, message)
    assert str(info.value) == f"{code.name}: {message}"


def _assert_server_saw_cancel(fake: FakeInference, prompt: str) -> None:
    end = fake.slow_end(prompt)
    assert end.terminated.wait(1.0), "the RPC's termination callback never fired"
    assert end.cancelled.wait(1.0), "servicer never saw context.is_active() go False"


def test_break_cancels_the_rpc(client, fake):
    for chunk in client.generate("slow-break"):
        assert chunk.text == "a"
        break
    _assert_server_saw_cancel(fake, "slow-break")


def test_close_cancels_the_rpc(client, fake):
    stream = client.generate("slow-close")
    assert next(stream).text == "a"
    stream.close()
    _assert_server_saw_cancel(fake, "slow-close")


def test_garbage_collection_cancels_the_rpc(client, fake):
    stream = client.generate("slow-gc")
    next(stream)
    del stream
    gc.collect()
    _assert_server_saw_cancel(fake, "slow-gc")


def test_unstarted_stream_sends_nothing(client, fake):
    stream = client.generate("ab")
    del stream
    assert client.complete("cd").text == "cd"
    assert [r.prompt for r in fake.requests] == ["cd"]


def test_deadline_exceeded(address, fake):
    with Client(address) as c, pytest.raises(PdserveError) as info:
        c.complete("slow-deadline", timeout=0.3)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.slow_end("slow-deadline").terminated.wait(1.0)  # the server ended it too
    with Client(address, timeout=0.3) as c, pytest.raises(PdserveError) as info:
        c.complete("slow-default-deadline")  # the client's default deadline
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unary_calls(client):
    assert client.abort("known") is True
    assert client.abort("unknown") is False
    info = client.model_info()
    assert (info.model, info.max_model_len, list(info.eos_token_ids)) == ("fake", 64, [0])
    stats = client.stats()
    assert (stats.num_queued, stats.workers[0].worker_id) == (2, "d0")


def test_health_and_wait_ready(server, address):
    health_servicer = server[2]
    with Client(address) as c:
        assert c.health() == "SERVING"
        c.wait_ready(1.0)
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert c.health() == "NOT_SERVING"
        with pytest.raises(TimeoutError, match=address):
            c.wait_ready(0.3)
        threading.Timer(0.3, health_servicer.set,
                        ("", health_pb2.HealthCheckResponse.SERVING)).start()
        start = time.monotonic()
        c.wait_ready(5.0)
        assert time.monotonic() - start < 2.0


def test_no_server():
    address = _free_address()
    with Client(address) as c:
        with pytest.raises(PdserveError) as info:
            c.health(timeout=1.0)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(TimeoutError, match=address):
            c.wait_ready(0.3)


# ---- AsyncClient (asyncio.run in each test; no pytest-asyncio) ------------------------------


def test_async_generate_and_complete(address, fake):
    async def main() -> tuple[list[GenerateChunk], str]:
        async with AsyncClient(address) as c:
            chunks = [chunk async for chunk in c.generate("hey", request_id="a1")]
            out = await c.complete([104, 105], sampling=SamplingParams(max_tokens=1))
            return chunks, out.text

    chunks, text = asyncio.run(main())
    assert "".join(c.text for c in chunks) == "hey" and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage == Usage(3, 3, 1) and chunks[0].request_id == "a1"
    assert text == "h"
    assert not fake.requests[0].HasField("sampling") and fake.requests[1].HasField("sampling")


@pytest.mark.parametrize("prompt", sorted(ERRORS))
def test_async_status_surfaces_as_pdserve_error(address, prompt):
    async def main() -> None:
        async with AsyncClient(address) as c:
            await c.complete(prompt)

    with pytest.raises(PdserveError) as info:
        asyncio.run(main())
    assert (info.value.code, info.value.message) == ERRORS[prompt]


@pytest.mark.parametrize("how", ["break", "aclose", "task_cancel"])
def test_async_leaving_the_stream_cancels_the_rpc(address, fake, how):
    async def consume(c: AsyncClient) -> None:
        stream = c.generate(prompt)
        if how == "aclose":
            assert (await stream.__anext__()).text == "a"
            await stream.aclose()
            return
        async for _ in stream:
            if how == "break":
                break

    async def main() -> bool:
        async with AsyncClient(address) as c:
            task = asyncio.ensure_future(consume(c))
            if how == "task_cancel":
                await asyncio.sleep(0.2)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # The channel stays open: the cancel must come from the stream, not from close().
            return await asyncio.to_thread(fake.slow_end(prompt).terminated.wait, 1.0)

    prompt = f"slow-async-{how}"
    assert asyncio.run(main()), "the RPC's termination callback never fired"
    assert fake.slow_end(prompt).cancelled.wait(1.0), "servicer never saw is_active() False"


def test_async_deadline_and_unary(address):
    async def main() -> tuple:
        async with AsyncClient(address, timeout=0.3) as c:
            with pytest.raises(PdserveError) as info:
                await c.complete("slow-async-deadline")
            info2 = await c.model_info()
            return (info.value.code, await c.abort("known"), info2.model,
                    (await c.stats()).num_inflight, await c.health())

    assert asyncio.run(main()) == (grpc.StatusCode.DEADLINE_EXCEEDED, True, "fake", 1, "SERVING")


def test_async_wait_ready(server, address):
    health_servicer = server[2]
    missing = _free_address()

    async def main() -> None:
        async with AsyncClient(address) as c:
            health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(TimeoutError, match=address):
                await c.wait_ready(0.3)
            asyncio.get_running_loop().call_later(
                0.3, health_servicer.set, "", health_pb2.HealthCheckResponse.SERVING)
            await c.wait_ready(5.0)
        async with AsyncClient(missing) as c:
            with pytest.raises(TimeoutError, match=missing):
                await c.wait_ready(0.3)

    asyncio.run(main())


# ---- TLS and the connection flags ----


def test_client_speaks_tls_to_a_tls_server(tmp_path):
    """Client and AsyncClient over TLS, verifying the server and presenting a client cert."""
    from pdserve.client import ClientTLS
    from pdserve.tls import TLSFiles
    from tests.certs import write_pki

    pki = write_pki(tmp_path)
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pdserve_pb2_grpc.add_InferenceServicer_to_server(FakeInference(), srv)
    port = srv.add_secure_port(
        "127.0.0.1:0", TLSFiles(pki.server_cert, pki.server_key, pki.ca).server_credentials())
    srv.start()
    address, tls = f"127.0.0.1:{port}", ClientTLS(pki.ca, pki.client_cert, pki.client_key)
    try:
        with Client(address, timeout=5, tls=tls) as c:
            assert c.complete("hey").text == "hey"
        with Client(address, timeout=5) as c, pytest.raises(PdserveError) as info:
            c.complete("hey")  # plaintext to a TLS port
        assert info.value.code == grpc.StatusCode.UNAVAILABLE

        async def main():
            async with AsyncClient(address, timeout=5, tls=tls) as c:
                return (await c.model_info()).model

        assert asyncio.run(main()) == "fake"
    finally:
        srv.stop(0)


def test_client_tls_refuses_half_a_client_certificate(tmp_path):
    from pdserve.client import ClientTLS

    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="both"):
        ClientTLS(cert=str(cert))
    with pytest.raises(ValueError, match="does not exist"):
        ClientTLS(ca=str(tmp_path / "missing.pem"))


def test_connection_flags(tmp_path, monkeypatch):
    import argparse

    from pdserve.client import ClientTLS
    from pdserve.client.options import add_connection_args, connection_kwargs

    for name in ("PDSERVE_API_TOKEN", "PDSERVE_API_TOKEN_FILE", "PDSERVE_TLS", "PDSERVE_TLS_CA",
                 "PDSERVE_TLS_CLIENT_CERT", "PDSERVE_TLS_CLIENT_KEY"):
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    token_file, ca = tmp_path / "token", tmp_path / "ca.pem"
    token_file.write_text("# the router's\nsecret-token\n")
    ca.write_text("x")

    def kwargs(*argv):
        return connection_kwargs(parser.parse_args(list(argv)))

    assert kwargs() == {"api_token": None, "tls": None}
    assert kwargs("--api-token-file", str(token_file))["api_token"] == "secret-token"
    assert kwargs("--tls-ca", str(ca))["tls"] == ClientTLS(str(ca))
    assert kwargs("--tls")["tls"] == ClientTLS()
    with pytest.raises(ValueError, match="--api-token and --api-token-file"):
        kwargs("--api-token", "t", "--api-token-file", str(token_file))
    monkeypatch.setenv("PDSERVE_API_TOKEN_FILE", str(token_file))
    parser = argparse.ArgumentParser()
    add_connection_args(parser)
    assert kwargs()["api_token"] == "secret-token"
