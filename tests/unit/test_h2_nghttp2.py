"""The router's HTTP/2 gRPC front (pdserve.router.h2) held to an independent implementation:
nghttp2's own clients (Debian `nghttp2-client`; scripts/setup.sh installs it where it can, as
root with apt). `nghttp` makes one call and must see a well-formed gRPC reply; `h2load` runs
256 concurrent streams over 8 connections, with windows small enough that every reply waits
on the client's WINDOW_UPDATEs, and must see every request succeed."""

from __future__ import annotations

import asyncio
import re
import shutil

import pytest

from pdserve.router.h2.limits import Limits
from pdserve.router.h2.server import GrpcServer, Method

NGHTTP, H2LOAD = shutil.which("nghttp"), shutil.which("h2load")
pytestmark = pytest.mark.skipif(
    NGHTTP is None or H2LOAD is None,
    reason="nghttp2's clients (nghttp, h2load) are not installed: Debian's nghttp2-client, "
           "which scripts/setup.sh installs only when run as root with apt-get")

ECHO, BIG = "/t.S/Echo", "/t.S/Big"
BIG_BYTES = 100 * 1024  # a reply over the windows below: it must wait for WINDOW_UPDATEs
GRPC = ("-H", "content-type: application/grpc", "-H", "te: trailers")


def message(payload: bytes) -> bytes:
    """One gRPC length-prefixed message, uncompressed."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


async def echo(request, context):
    return request


async def big(request, context):
    return request * (BIG_BYTES // len(request))


def raw(data: bytes) -> bytes:
    return data


def run_against_front(tmp_path, *argv: str) -> str:
    """Run a client (`argv`, the URL's port as {port}, the body file as {body}) against a
    GrpcServer serving ECHO and BIG; its output (stdout and stderr)."""
    body = tmp_path / "request.bin"
    body.write_bytes(message(b"pdserve!"))

    async def main() -> str:
        server = GrpcServer({ECHO: Method("unary", echo, raw, raw),
                             BIG: Method("unary", big, raw, raw)}, limits=Limits())
        port = server.bind("127.0.0.1", 0)
        await server.start()
        try:
            client = await asyncio.create_subprocess_exec(
                *(a.format(port=port, body=body) for a in argv),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asyncio.wait_for(client.communicate(), 120)
            assert client.returncode == 0, out.decode(errors="replace")
            return out.decode(errors="replace")
        finally:
            await server.stop(0)

    return asyncio.run(main())


def test_nghttp_call_gets_a_well_formed_grpc_reply(tmp_path):
    out = run_against_front(tmp_path, NGHTTP, "-v", *GRPC, "-d", "{body}",
                            f"http://127.0.0.1:{{port}}{ECHO}")
    assert re.search(r"recv \(stream_id=\d+\) :status: 200", out), out
    assert re.search(r"recv \(stream_id=\d+\) content-type: application/grpc", out), out
    assert re.search(r"recv \(stream_id=\d+\) grpc-status: 0", out), out  # trailers
    assert "pdserve!" in out  # the echoed message
    assert "recv RST_STREAM" not in out and "recv GOAWAY" not in out, out  # nothing cut short


@pytest.mark.parametrize("path", [ECHO, BIG])
def test_h2load_256_streams_over_8_connections_all_succeed(tmp_path, path):
    requests = 2048
    out = run_against_front(tmp_path, H2LOAD, "-n", str(requests), "-c", "8", "-m", "32",
                            "-w", "14", "-W", "16",  # 16 KiB per stream, 64 KiB per connection
                            *GRPC, "-d", "{body}", f"http://127.0.0.1:{{port}}{path}")
    done = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                     r"(\d+) failed, (\d+) errored, (\d+) timeout", out)
    assert done is not None, out
    assert [int(n) for n in done.groups()] == [requests] * 4 + [0, 0, 0], out
    assert re.search(rf"status codes: {requests} 2xx", out), out
    if path == BIG:  # every reply came whole through the small windows
        received = re.search(r"traffic: \S+ \((\d+)\) total", out)
        assert received is not None and int(received.group(1)) > requests * BIG_BYTES, out
