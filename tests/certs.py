"""Throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1/localhost and a client
certificate, all signed by the CA, written as PEM files into a directory.

    pki = write_pki(tmp_path)
    TLSFiles(pki.server_cert, pki.server_key, pki.ca)      # a server requiring client certs
    ClientTLS(pki.ca, pki.client_cert, pki.client_key)     # a client presenting one

`write_pki(dir, name="other")` makes an unrelated CA (and its certificates): a peer it signed
must be refused by a server trusting the first. EC P-256 keys: fast to generate.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class PKI:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _leaf(ca_key, ca_name: x509.Name, subject: str, usage, sans) -> tuple:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(subject, ca_name, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def write_pki(directory: Path | str, name: str = "pdserve-test") -> PKI:
    """A CA, a server certificate (SANs 127.0.0.1 and localhost) and a client certificate."""
    out = Path(directory) / name
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{name} CA")
    ca = (_builder(f"{name} CA", ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    sans = [x509.IPAddress(ipaddress.ip_address(HOSTS[0])), x509.DNSName(HOSTS[1])]
    server_key, server = _leaf(ca_key, ca_name, HOSTS[1], ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_key, client = _leaf(ca_key, ca_name, f"{name} client",
                               ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return PKI(ca=_write_cert(ca, out / "ca.pem"),
               server_cert=_write_cert(server, out / "server.pem"),
               server_key=_write_key(server_key, out / "server.key"),
               client_cert=_write_cert(client, out / "client.pem"),
               client_key=_write_key(client_key, out / "client.key"))
