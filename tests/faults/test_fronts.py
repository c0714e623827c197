"""Finding 2: the public fronts speak TLS (mutual with a client CA), take API tokens from a
file, and GetStats no longer hands worker addresses to callers.

Real servers over sockets: the router's gRPC server and the OpenAI front (uvicorn) around the
real Router (`fronts_harness`), with certificates from `tests.certs`.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.client import AsyncClient, ClientTLS, PdserveError
from pdserve.launch.settings import ServeSettings
from pdserve.router.validation import ModelContext
from pdserve.tls import TLSFiles
from tests.certs import write_pki
from tests.faults.fronts_harness import client_ssl, fronts
from tests.faults.router_fakes import load

CALL_S = 10.0


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny", max_model_len=512)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """Another CA and its certificates: signed by nobody the server trusts."""
    return write_pki(tmp_path_factory.mktemp("pki-other"), "stranger")


async def _model_info(address: str, tls: ClientTLS | None, token: str | None = None) -> str:
    """The served model's name, or the status code name the call failed with."""
    async with AsyncClient(address, timeout=CALL_S, api_token=token, tls=tls) as client:
        try:
            return (await client.model_info()).model
        except PdserveError as exc:
            return exc.code.name


def test_grpc_front_serves_mutual_tls(model, pki, stranger):
    server_tls = TLSFiles(pki.server_cert, pki.server_key, pki.ca)

    async def main():
        async with fronts(model, tls=server_tls) as f:
            return [await _model_info(f.address, tls) for tls in (
                ClientTLS(pki.ca, pki.client_cert, pki.client_key),  # trusted both ways
                None,  # plaintext to a TLS port
                ClientTLS(pki.ca),  # no client certificate
                ClientTLS(pki.ca, stranger.client_cert, stranger.client_key),  # foreign cert
                ClientTLS(stranger.ca, pki.client_cert, pki.client_key),  # server not trusted
            )], f.server.tls

    answers, tls_on = asyncio.run(main())
    assert answers == ["tiny"] + ["UNAVAILABLE"] * 4
    assert tls_on


def test_http_front_serves_mutual_tls(model, pki, stranger):
    server_tls = TLSFiles(pki.server_cert, pki.server_key, pki.ca)

    async def get(url: str, verify) -> int | str:
        async with httpx.AsyncClient(verify=verify, timeout=CALL_S) as http:
            try:
                return (await http.get(f"{url}/v1/models")).status_code
            except httpx.HTTPError as exc:
                return type(exc).__name__

    async def main():
        async with fronts(model, tls=server_tls, http=True) as f:
            url = f.http_url
            plain = "http" + url.removeprefix("https")
            return url, [await get(url, client_ssl(pki)),
                         await get(url, client_ssl(pki, with_cert=False)),
                         await get(url, client_ssl(stranger)),
                         await get(plain, False)]

    url, answers = asyncio.run(main())
    assert url.startswith("https://127.0.0.1:")
    assert answers[0] == 200
    # no answer at all to the others: the TLS handshake (or plaintext) is refused
    assert all(isinstance(a, str) and a.endswith("Error") for a in answers[1:]), answers


def test_server_only_tls_without_a_client_ca(model, pki):
    async def main():
        async with fronts(model, tls=TLSFiles(pki.server_cert, pki.server_key)) as f:
            return (await _model_info(f.address, ClientTLS(pki.ca)),
                    await _model_info(f.address, None))

    assert asyncio.run(main()) == ("tiny", "UNAVAILABLE")


def test_api_tokens_from_a_file(model, pki, tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# one token per client\nalpha-token\n\nbeta-token\n")
    tokens = ServeSettings(api_token_file=str(path)).api_tokens()
    assert tokens == ("alpha-token", "beta-token")
    tls = TLSFiles(pki.server_cert, pki.server_key)

    async def main():
        async with fronts(model, tls=tls, api_tokens=tokens) as f:
            return [await _model_info(f.address, ClientTLS(pki.ca), token)
                    for token in ("alpha-token", "beta-token", "gamma", None)]

    assert asyncio.run(main()) == ["tiny", "tiny", "UNAUTHENTICATED", "UNAUTHENTICATED"]


def test_api_token_given_two_ways_is_refused(tmp_path):
    with pytest.raises(ValueError, match="api_token and api_token_file"):
        ServeSettings.load(None, {"PDSERVE_API_TOKEN": "a",
                                  "PDSERVE_API_TOKEN_FILE": str(tmp_path / "t")})
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="holds no token"):
        ServeSettings(api_token_file=str(empty)).api_tokens()
    with pytest.raises(ValueError, match="--tls-key"):
        ServeSettings(tls_cert=str(empty)).tls()


def test_get_stats_hides_worker_addresses(model, pki):
    tls = TLSFiles(pki.server_cert, pki.server_key)

    async def main():
        async with fronts(model, tls=tls) as f, AsyncClient(
                f.address, timeout=CALL_S, tls=ClientTLS(pki.ca)) as c:
            return (await c.stats()).workers, f.router.decode["decode-0"].address

    workers, real_address = asyncio.run(main())
    assert [(w.worker_id, w.role, w.up, w.num_blocks) for w in workers] == [
        ("decode-0", "decode", True, load("decode-0").num_blocks)]  # loads stay public
    assert real_address.startswith("127.0.0.1:")  # the router knows it, callers don't
    assert workers[0].address == ""

