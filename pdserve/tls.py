"""TLSFiles: a certificate, its key and an optional CA, as PEM files, for gRPC and HTTP.

One type for both planes: the public fronts (`--tls-cert/--tls-key`, `--tls-client-ca` to
require client certificates) and, optionally, the worker plane (mutual TLS between router and
workers, on top of the cluster secret). Files are read when credentials are built, so a
rotated certificate is picked up by the next server or channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSFiles:
    cert: str  # PEM certificate chain
    key: str  # PEM private key
    ca: str | None = None  # PEM CA bundle: verify the peer's certificate against it

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS {name} file {path!r} does not exist")

    @classmethod
    def optional(cls, cert: str | None, key: str | None,
                 ca: str | None = None) -> TLSFiles | None:
        """TLS when cert and key are both given; None when neither; ValueError for one alone."""
        if not cert and not key:
            if ca:
                raise ValueError("a TLS CA was given without a certificate and key")
            return None
        if not cert or not key:
            raise ValueError("TLS needs both a certificate and its key (--tls-cert, --tls-key)")
        return cls(cert, key, ca)

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side; with a CA, clients must present a certificate it signed (mTLS)."""
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca), require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against the CA, present our own certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca), private_key=self._read(self.key),
            certificate_chain=self._read(self.cert))
