"""The router's gRPC fronts driven by real gRPC clients: its own HTTP/2 server
(pdserve.router.h2) and, with `--grpc-server grpcio`, grpc.aio's (router.grpcio_server), each
test on both, the same method table on each, the same status codes; the details the router's
front words itself are held to (DETAILS), grpc.aio's server words them its own way.

test_h2_protocol.py checks the server frame by frame with hand-written frames; here the
clients are grpcio's C-core (`grpc.aio` channels, the generated health and reflection stubs,
and generic `unary_unary`/`unary_stream` calls on raw bytes), so what is proven is that the
front interoperates with the implementation every gRPC client library is measured against:
the method table built as router/server.py builds it (grpc.health.v1 Check/Watch through
`health.aio.HealthServicer`, reflection through `reflection.aio.ReflectionServicer` as a
bidi method) answers list_services and file_containing_symbol, one response per request in
order on one bidi call; a Watch stream follows `set()` and a cancelled Watch cancels its
handler; a client deadline ends the call with DEADLINE_EXCEEDED and cancels the handler;
aborts (with percent-encoded UTF-8 details), handler exceptions, unknown methods and
unparsable requests reach the client as the status codes grpc's own servers give; 20 MB of
streamed responses and a 3 MiB request cross intact through C-core's flow control, a 5 MiB
request is refused with RESOURCE_EXHAUSTED; TLS negotiates ALPN h2, and with a client CA a
client without a certificate is refused while one with a certificate the CA signed is
served; two servers share a port (SO_REUSEPORT) and the kernel spreads fresh connections
over both, then sends all to the one left; a graceful stop lets an in-flight stream run for
its grace, ends it with UNAVAILABLE, and leaves nothing to connect to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from pdserve.router.h2.limits import Limits
from pdserve.router.h2.server import Method
from pdserve.router.server import FRONTS
from pdserve.tls import TLSFiles
from tests.certs import write_pki

SERVICE = "t.Test"
ECHO, SLEEP, ABORT, BOOM, PARSE, BIG, TICK, ID = (
    f"/{SERVICE}/{name}" for name in ("Echo", "Sleep", "Abort", "Boom", "Parse", "Big", "Tick",
                                      "Id"))
SERVICES = (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ABORT_DETAILS = "field x: bad é%"
ESCAPES = "50%41 off, %zz, 100%"  # read as percent-escapes if the server sent '%' bare
BIG_COUNT, BIG_SIZE = 200, 100 * 1024
MIB = 1024 * 1024
MAX_MESSAGE = 4 * MIB  # the server's request size limit (grpc's servers' default)
FRESH = ("grpc.use_local_subchannel_pool", 1)  # a channel of its own: a new TCP connection
# The details the router's own front words itself; grpc.aio's server gives grpc's own words
# there (the router passes them on as they are), so only their status codes are held to
DETAILS = {"boom": "Unexpected RuntimeError: boom", "unknown": f"method /{SERVICE}/Nope not found",
           "oversized": f"request message of {5 * MIB} bytes is over the {MAX_MESSAGE}-byte limit",
           "stopped": "the server is shutting down"}


def check_details(front: str, error: grpc.aio.AioRpcError | str | None, key: str) -> None:
    details = error if isinstance(error, str) or error is None else error.details()
    if front == "h2":
        assert details == DETAILS[key]


def big_message(i: int) -> bytes:
    """The i-th message of the BIG stream: 100 KiB, different from every other one."""
    return (i.to_bytes(4, "big") + bytes((i % 251,)) * 60)[:64] * (BIG_SIZE // 64)


def _serialize(message) -> bytes:
    return message.SerializeToString()


@dataclass
class Stand:
    """The stand-in handlers' shared state, for the test to look at."""

    server_id: bytes = b"A"
    sleep_cancelled: bool = False
    ticks: int = 0
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)

    async def echo(self, request: bytes, context) -> bytes:
        return request

    async def sleep(self, request: bytes, context) -> bytes:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.sleep_cancelled = True
            raise
        return b"woke"

    async def abort(self, request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.decode())
        return b"not reached"

    async def boom(self, request: bytes, context) -> bytes:
        raise RuntimeError("boom")

    async def parse(self, request, context):
        return health_pb2.HealthCheckResponse(status=SERVING)

    async def big(self, request: bytes, context):
        for i in range(BIG_COUNT):
            yield big_message(i)

    async def tick(self, request: bytes, context):
        for i in range(1000):
            self.ticks += 1
            yield i.to_bytes(4, "big")
            await asyncio.sleep(0.02)

    async def ident(self, request: bytes, context) -> bytes:
        return self.server_id

    def methods(self) -> dict[str, Method]:
        """Health and reflection as router/server.py's `_methods` builds them, and the
        stand-ins on raw bytes."""
        reflection_servicer = reflection.aio.ReflectionServicer(SERVICES)
        check = health_pb2.HealthCheckRequest.FromString

        def raw(kind: str, handler) -> Method:
            return Method(kind, handler, bytes, bytes)

        return {
            f"/{health.SERVICE_NAME}/Check": Method("unary", self.health.Check, check,
                                                    _serialize),
            f"/{health.SERVICE_NAME}/Watch": Method("stream", self.health.Watch, check,
                                                    _serialize),
            f"/{reflection.SERVICE_NAME}/ServerReflectionInfo": Method(
                "bidi", reflection_servicer.ServerReflectionInfo,
                reflection_pb2.ServerReflectionRequest.FromString, _serialize),
            ECHO: raw("unary", self.echo),
            SLEEP: raw("unary", self.sleep),
            ABORT: raw("unary", self.abort),
            BOOM: raw("unary", self.boom),
            PARSE: Method("unary", self.parse, check, _serialize),
            BIG: raw("stream", self.big),
            TICK: raw("stream", self.tick),
            ID: raw("unary", self.ident),
        }


@pytest.fixture(params=sorted(FRONTS))
def front(request) -> str:
    """Each test runs against both fronts: the router's own and grpc.aio's server."""
    return request.param


@contextlib.asynccontextmanager
async def served(stand: Stand, front: str, tls: TLSFiles | None = None, port: int = 0):
    """A started server of kind `front` for `stand`'s methods; yields (server, port)."""
    server = FRONTS[front](stand.methods(), limits=Limits(max_message=MAX_MESSAGE))
    port = server.bind("127.0.0.1", port)
    await server.start(tls)
    try:
        yield server, port
    finally:
        await server.stop(0)


def run(scenario, timeout: float = 5.0):
    """asyncio.run with a bound: a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(scenario(), timeout))


def channel(port: int, *options) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[FRESH, *options])


async def failure(coro) -> grpc.aio.AioRpcError:
    """The error a call ends with (fails the test if it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await coro
    return caught.value


async def eventually(predicate, within: float) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


# ---- 1. reflection ----

def test_reflection_bidi_lists_services_and_files_in_order(front):
    ask = reflection_pb2.ServerReflectionRequest

    async def main():
        async with served(Stand(), front) as (_, port), channel(port) as ch:
            call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
            listed = ask(list_services="")
            await call.write(listed)
            first = await call.read()  # answered while the request stream is still open
            symbol = ask(file_containing_symbol=health.SERVICE_NAME)
            missing = ask(file_containing_symbol="no.such.Service")
            await call.write(symbol)
            await call.write(missing)
            await call.done_writing()
            rest = [await call.read(), await call.read()]
            end = await call.read()
            return listed, symbol, missing, first, rest, end, await call.code()

    listed, symbol, missing, first, (second, third), end, code = run(main)
    assert first.original_request == listed
    assert [s.name for s in first.list_services_response.service] == sorted(SERVICES)
    assert second.original_request == symbol
    protos = second.file_descriptor_response.file_descriptor_proto
    assert len(protos) == 1 and len(protos[0]) > 0
    file = descriptor_pb2.FileDescriptorProto.FromString(protos[0])
    assert file.name == health_pb2.DESCRIPTOR.name == "grpc_health/v1/health.proto"
    assert [s.name for s in file.service] == ["Health"]
    assert third.original_request == missing
    assert third.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert end is grpc.aio.EOF
    assert code == grpc.StatusCode.OK


# ---- 2. health ----

def test_health_watch_follows_set_and_cancel_ends_the_handler(front):
    stand = Stand()
    name = "pdserve.v1.Inference"
    request = health_pb2.HealthCheckRequest

    async def main():
        await stand.health.set(name, SERVING)
        async with served(stand, front) as (_, port), channel(port) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            checked = (await stub.Check(request(service=""), timeout=2)).status
            watch = stub.Watch(request(service=name))
            seen = [(await watch.read()).status]
            watchers = dict(stand.health._watcher_count_by_service)
            await stand.health.set(name, NOT_SERVING)
            seen.append((await watch.read()).status)
            watch.cancel()
            gone = await eventually(
                lambda: name not in stand.health._watcher_count_by_service, within=1.0)
            return checked, seen, watchers, gone, await watch.code()

    checked, seen, watchers, gone, code = run(main)
    assert checked == SERVING
    assert seen == [SERVING, NOT_SERVING]
    assert watchers == {name: 1}
    assert gone, "the Watch handler was still running 1 s after the client cancelled"
    assert code == grpc.StatusCode.CANCELLED


# ---- 3. client deadline ----

def test_client_deadline_gives_deadline_exceeded_and_cancels_the_handler(front):
    stand = Stand()

    async def main():
        async with served(stand, front) as (_, port), channel(port) as ch:
            start = time.monotonic()
            error = await failure(ch.unary_unary(SLEEP)(b"", timeout=0.3))
            elapsed = time.monotonic() - start
            cancelled = await eventually(lambda: stand.sleep_cancelled, within=1.0)
            return error.code(), elapsed, cancelled

    code, elapsed, cancelled = run(main)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0.25 < elapsed < 1.0
    assert cancelled, "the handler never saw CancelledError"


# ---- 4. status codes ----

def test_status_codes_and_details_reach_the_client(front):
    async def main():
        async with served(Stand(), front) as (_, port), channel(port) as ch:
            return [await failure(ch.unary_unary(path)(payload, timeout=2)) for path, payload in
                    ((ABORT, ABORT_DETAILS.encode()), (ABORT, ESCAPES.encode()), (BOOM, b""),
                     (f"/{SERVICE}/Nope", b""), (PARSE, b"\xff\xff\xff"))]

    aborted, escapes, boom, unknown, unparsable = run(main)
    assert aborted.code() == escapes.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert aborted.details() == ABORT_DETAILS
    assert escapes.details() == ESCAPES
    assert boom.code() == grpc.StatusCode.UNKNOWN
    check_details(front, boom, "boom")
    assert unknown.code() == grpc.StatusCode.UNIMPLEMENTED
    check_details(front, unknown, "unknown")
    assert unparsable.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unparsable.details() == f"the request is not a valid message for {PARSE}"


# ---- 5. a large streamed response ----

# C-core's own settings (4-8 MiB windows and frames, grown by BDP probes), then 16 KiB frames
# and no BDP probing: 64 KiB windows, so every message waits for WINDOW_UPDATEs
@pytest.mark.parametrize("options", [(), (("grpc.http2.max_frame_size", 16384),
                                          ("grpc.http2.bdp_probe", 0))],
                         ids=["core-defaults", "small-frames-and-windows"])
def test_large_server_stream_arrives_whole_and_in_order(front, options):
    async def main():
        async with served(Stand(), front) as (_, port), channel(port, *options) as ch:
            call = ch.unary_stream(BIG)(b"", timeout=4)
            received = [message async for message in call]
            return received, await call.code()

    received, code = run(main)
    assert code == grpc.StatusCode.OK
    assert len(received) == BIG_COUNT
    for i, message in enumerate(received):
        assert message == big_message(i), f"message {i} differs"


# ---- 6. large requests ----

def test_large_request_echoed_and_oversized_request_refused(front):
    big = bytes(range(256)) * (3 * MIB // 256)
    huge = b"\x07" * (5 * MIB)
    options = (("grpc.max_receive_message_length", 8 * MIB),
               ("grpc.max_send_message_length", 8 * MIB))

    async def main():
        async with served(Stand(), front) as (_, port), channel(port, *options) as ch:
            echoed = await ch.unary_unary(ECHO)(big, timeout=3)
            refused = await failure(ch.unary_unary(ECHO)(huge, timeout=3))
            after = await ch.unary_unary(ECHO)(b"still fine", timeout=2)
            return echoed, refused, after

    echoed, refused, after = run(main)
    assert len(echoed) == len(big) and echoed == big
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    check_details(front, refused, "oversized")
    assert after == b"still fine"  # the connection survived the refusal


# ---- 7. TLS ----

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("h2-pki"))


def _secure(port: int, ca: str, cert: str | None = None, key: str | None = None):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=[FRESH])


async def _echo_or_code(ch: grpc.aio.Channel, payload: bytes):
    async with ch:
        try:
            return await ch.unary_unary(ECHO)(payload, timeout=2)
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def test_tls_server_serves_h2_over_alpn(front, pki):
    async def main():
        tls = TLSFiles(pki.server_cert, pki.server_key)
        async with served(Stand(), front, tls=tls) as (_, port):
            secure = await _echo_or_code(_secure(port, pki.ca), b"over tls")
            plain = await _echo_or_code(channel(port), b"plaintext")
            return secure, plain

    secure, plain = run(main)
    assert secure == b"over tls"
    assert plain == grpc.StatusCode.UNAVAILABLE


def test_tls_with_client_ca_requires_a_client_certificate(front, pki):
    async def main():
        tls = TLSFiles(pki.server_cert, pki.server_key, pki.ca)
        async with served(Stand(), front, tls=tls) as (_, port):
            anonymous = await _echo_or_code(_secure(port, pki.ca), b"no cert")
            known = await _echo_or_code(
                _secure(port, pki.ca, pki.client_cert, pki.client_key), b"with cert")
            return anonymous, known

    anonymous, known = run(main)
    assert anonymous == grpc.StatusCode.UNAVAILABLE
    assert known == b"with cert"


# ---- 8. SO_REUSEPORT ----

def test_two_servers_share_a_port(front):
    first, second = Stand(server_id=b"A"), Stand(server_id=b"B")

    async def ask(port: int) -> bytes:
        async with channel(port) as ch:
            return await ch.unary_unary(ID)(b"", timeout=2)

    async def main():
        async with (served(first, front) as (a, port),
                    served(second, front, port=port) as (_, same)):
            seen = []
            while len(seen) < 200 and (len(seen) < 20 or len(set(seen)) < 2):
                seen.append(await ask(port))
            await a.stop(0)
            after = [await ask(port) for _ in range(20)]
            return same, port, seen, after

    same, port, seen, after = run(main, timeout=10)
    assert same == port
    assert set(seen) == {b"A", b"B"}, f"{len(seen)} connections all went to {set(seen)}"
    assert after == [b"B"] * 20


# ---- 9. graceful stop ----

def test_graceful_stop_ends_running_stream_after_grace_and_refuses_new_channels(front):
    stand = Stand()

    async def main():
        async with served(stand, front) as (server, port):
            async with channel(port) as ch:
                call = ch.unary_stream(TICK)(b"", timeout=5)
                await call.read()
                before = stand.ticks
                start = time.monotonic()
                stopping = asyncio.create_task(server.stop(grace=0.5))
                received = 0
                error = None
                try:
                    while await call.read() is not grpc.aio.EOF:
                        received += 1
                except grpc.aio.AioRpcError as exc:
                    error = exc
                ended = time.monotonic() - start
                await stopping
                code, details = await call.code(), await call.details()
            late = await _echo_or_code(channel(port), b"after stop")
            return error, code, details, received, stand.ticks - before, ended, late

    error, code, details, received, ticks, ended, late = run(main)
    assert error is not None and code == grpc.StatusCode.UNAVAILABLE
    check_details(front, details, "stopped")
    assert 0.45 <= ended < 1.5, ended
    assert received >= 10 and ticks >= 10, "the stream did not run on during the grace"
    assert late == grpc.StatusCode.UNAVAILABLE
