"""Issue 16, finding 1 ("optional mTLS"): mutual TLS on the worker plane's gRPC.

Real prefill and decode services (in this process, real gRPC on 127.0.0.1, real gloo KV
channels) with TLS from their WorkerSpec, and the real Router dialing them with `worker_tls`.
One certificate for the whole plane, with the DNS name `pdserve-worker` and both the server
and client EKUs; the router dials by IP and checks that name. What is proven:
- a request is served end to end over TLS, and a router without TLS can't reach the workers;
- even holding the cluster secret, a caller without a client certificate (plaintext, or TLS
  with no certificate) or with one from another CA is refused;
- the router refuses a worker whose certificate, though from the cluster CA, lacks the name;
- certificate, key and CA come all three or not at all (settings, WorkerSpec).
"""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.decode_worker.group import start_decode_rank
from pdserve.decode_worker.service import DecodeService
from pdserve.engine.models.parallel import TensorParallel
from pdserve.kvtransfer.rendezvous import GlooListener
from pdserve.launch.settings import ServeSettings
from pdserve.prefill_worker.service import PrefillService
from pdserve.proto import worker_pb2, worker_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.router import Router
from pdserve.router.validation import ModelContext
from pdserve.router.workers import worker_channel
from pdserve.tls import TLSFiles
from pdserve.worker_grpc import TLS_CHANNEL_OPTIONS, WORKER_TLS_NAME, bind, worker_server
from pdserve.worker_spec import WorkerSpec
from tests.faults.router_fakes import FakePrefill, collect, request
from tests.faults.worker_plane import AUTH, SECRET, worker_spec

TIMEOUT_S = 10.0


# ---- a throwaway PKI: CA -> one worker-plane certificate (server + client auth) ----


@dataclass(frozen=True)
class Plane:
    ca: str
    cert: str
    key: str

    def tls(self) -> TLSFiles:
        return TLSFiles(self.cert, self.key, self.ca)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer: str, public_key, signer, *, ca: bool, dns: str | None = None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                              critical=True))
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]),
                                        critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(directory: Path, name: str, obj) -> str:
    path = directory / name
    if isinstance(obj, ec.EllipticCurvePrivateKey):
        path.write_bytes(obj.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    else:
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    return str(path)


def write_plane(directory: Path, names: tuple[str, ...] = (WORKER_TLS_NAME,)) -> list[Plane]:
    """One CA, and for each DNS name a certificate of it (server and client auth) with key."""
    directory.mkdir(parents=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _pem(directory, "ca.crt",
              _cert(f"{directory.name} CA", f"{directory.name} CA", ca_key.public_key(), ca_key,
                    ca=True))
    planes = []
    for i, dns in enumerate(names):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = _cert(dns, f"{directory.name} CA", key.public_key(), ca_key, ca=False, dns=dns)
        planes.append(Plane(ca, _pem(directory, f"tls{i}.crt", leaf),
                            _pem(directory, f"tls{i}.key", key)))
    return planes


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[Plane, Plane, Plane]:
    """(the cluster's, a cluster-CA certificate named otherwise, another CA's)."""
    root = tmp_path_factory.mktemp("worker-tls")
    cluster, misnamed = write_plane(root / "cluster", (WORKER_TLS_NAME, "localhost"))
    [foreign] = write_plane(root / "foreign")
    return cluster, misnamed, foreign


# ---- real workers with TLS ----


@dataclass
class Workers:
    prefill: PrefillService
    decode: DecodeService


def tls_spec(model_dir: Path, worker_id: str, plane: Plane) -> WorkerSpec:
    return worker_spec(model_dir, worker_id, tls_cert=plane.cert, tls_key=plane.key,
                       tls_ca=plane.ca)


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, pki):
    cluster = pki[0]
    prefill = PrefillService(tls_spec(tiny_llama_dir, "prefill-0", cluster), SECRET)
    spec = tls_spec(tiny_llama_dir, "decode-0", cluster)
    listener = GlooListener(spec.host, secret=SECRET)
    worker = start_decode_rank(spec.engine_config(), TensorParallel(), listener,
                               [listener.endpoint], spec.model_name,
                               max_reservation_s=spec.max_reservation_s, tp_beat_s=spec.tp_beat_s)
    decode = DecodeService(worker, spec.worker_id, spec.host, SECRET, tls=spec.tls())
    yield Workers(prefill, decode)
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> ModelContext:
    return ModelContext.load(str(tiny_llama_dir), "tiny")


def _router(model: ModelContext, tls: TLSFiles | None) -> Router:
    return Router(model, RouterConfig(), RouterMetrics(), secret=SECRET, worker_tls=tls)


async def _serve_one(router: Router, workers: Workers) -> list:
    await router.add_worker("prefill-0", "prefill", workers.prefill.address)
    await router.add_worker("decode-0", "decode", workers.decode.address)
    try:
        await router.wait_ready(TIMEOUT_S)
        return await asyncio.wait_for(collect(router, request("tls-1")), 60)
    finally:
        await router.close()


def test_router_serves_over_worker_tls(model, workers, pki):
    messages = asyncio.run(_serve_one(_router(model, pki[0].tls()), workers))
    assert sum(len(m.token_ids) for m in messages) == 4  # request(): max_tokens 4, ignore_eos
    assert messages[-1].finish_reason == "length"


def test_router_without_tls_cannot_reach_tls_workers(model, workers):
    async def run():
        router = _router(model, None)
        await router.add_worker("decode-0", "decode", workers.decode.address)
        try:
            with pytest.raises(TimeoutError):
                await router.wait_ready(3.0)
            return router.decode["decode-0"].up
        finally:
            await router.close()

    assert asyncio.run(run()) is False


# ---- callers without the cluster's client certificate ----


def _get_load(channel: grpc.Channel) -> grpc.StatusCode:
    """GetLoad with the right cluster secret: OK, or the status it failed with."""
    try:
        worker_pb2_grpc.DecodeWorkerStub(channel).GetLoad(
            worker_pb2.GetLoadRequest(), metadata=AUTH, timeout=TIMEOUT_S)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


def _tls_channel(address: str, ca: str, cert: str | None = None,
                 key: str | None = None) -> grpc.Channel:
    read = Path.read_bytes
    creds = grpc.ssl_channel_credentials(
        read(Path(ca)), read(Path(key)) if key else None, read(Path(cert)) if cert else None)
    return grpc.secure_channel(address, creds, options=list(TLS_CHANNEL_OPTIONS))


def test_only_cluster_certificates_may_call(workers, pki):
    cluster, _, foreign = pki
    address = workers.decode.address
    # the control: the cluster's own certificate (and secret) gets through
    assert _get_load(_tls_channel(address, cluster.ca, cluster.cert, cluster.key)) == \
        grpc.StatusCode.OK
    # the secret alone is not enough: plaintext, TLS with no client certificate, a
    # certificate of another CA (server verified against the right CA, so only the client
    # side can fail)
    assert _get_load(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert _get_load(_tls_channel(address, cluster.ca)) == grpc.StatusCode.UNAVAILABLE
    assert _get_load(_tls_channel(address, cluster.ca, foreign.cert, foreign.key)) == \
        grpc.StatusCode.UNAVAILABLE
    # the prefill worker's port is the same kind of port
    assert _get_load(grpc.insecure_channel(workers.prefill.address)) == \
        grpc.StatusCode.UNAVAILABLE


def test_router_refuses_a_worker_without_the_plane_name(pki):
    """A worker certificate from the cluster CA but without `pdserve-worker`: not ours."""
    cluster, misnamed, _ = pki

    async def load_from(address: str) -> grpc.StatusCode:
        channel = worker_channel(address, cluster.tls())
        try:
            await worker_pb2_grpc.PrefillWorkerStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), metadata=AUTH, timeout=TIMEOUT_S)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await channel.close()

    codes = {}
    for name, plane in (("named", cluster), ("misnamed", misnamed)):
        server = worker_server(SECRET, 4, "fake-prefill")
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(FakePrefill(), server)
        port = bind(server, "127.0.0.1", plane.tls())
        server.start()
        try:
            codes[name] = asyncio.run(load_from(f"127.0.0.1:{port}"))
        finally:
            server.stop(grace=0).wait()
    assert codes == {"named": grpc.StatusCode.OK, "misnamed": grpc.StatusCode.UNAVAILABLE}


# ---- all three files or none ----


@pytest.mark.parametrize(("given", "missing"), [
    ({"cert": "c.pem"}, ["key", "ca"]),
    ({"cert": "c.pem", "key": "k.pem"}, ["ca"]),
    ({"ca": "ca.pem"}, ["cert", "key"]),
])
def test_tls_files_come_all_three_or_none(given, missing):
    with pytest.raises(ValueError) as caught:  # Service() calls it before starting anything
        ServeSettings(**{f"cluster_tls_{k}": v for k, v in given.items()}).cluster_tls()
    for name in missing:
        assert f"cluster_tls_{name}" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        WorkerSpec("w", "m", "m", **{f"tls_{k}": v for k, v in given.items()})
    for name in missing:
        assert f"tls_{name}" in str(caught.value)
    assert ServeSettings().cluster_tls() is None
    assert WorkerSpec("w", "m", "m").tls() is None


def test_missing_tls_file_fails_when_settings_are_read(tmp_path, pki):
    cluster = pki[0]
    settings = ServeSettings(cluster_tls_cert=cluster.cert, cluster_tls_key=cluster.key,
                             cluster_tls_ca=str(tmp_path / "absent.crt"))
    with pytest.raises(ValueError, match="absent.crt"):
        settings.cluster_tls()
    ok = ServeSettings(cluster_tls_cert=cluster.cert, cluster_tls_key=cluster.key,
                       cluster_tls_ca=cluster.ca)
    assert ok.cluster_tls() == cluster.tls()
