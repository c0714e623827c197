"""A client command's connection flags: the API token (inline or from a file) and TLS.

    --api-token / PDSERVE_API_TOKEN            the token inline (shows in `ps`: prefer a file)
    --api-token-file / PDSERVE_API_TOKEN_FILE  a file holding it
    --tls / PDSERVE_TLS                        TLS, verifying the router with the system roots
    --tls-ca / PDSERVE_TLS_CA                  TLS, verifying the router against this CA file
    --tls-client-cert, --tls-client-key        this client's certificate (PDSERVE_TLS_CLIENT_*),
                                               for a router started with --tls-client-ca

The client certificate has its own names: PDSERVE_TLS_CERT / _KEY are the server's.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pdserve.client.rpc import ClientTLS, read_token_file


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--api-token", default=env("PDSERVE_API_TOKEN"),
                        help="the router's API token (env PDSERVE_API_TOKEN; prefer a file)")
    parser.add_argument("--api-token-file", default=env("PDSERVE_API_TOKEN_FILE"),
                        help="file holding the API token (env PDSERVE_API_TOKEN_FILE)")
    parser.add_argument("--tls", action="store_true",
                        default=env("PDSERVE_TLS", "").lower() in ("1", "true", "yes", "on"),
                        help="TLS to the router, verified with the system's CAs (env PDSERVE_TLS)")
    parser.add_argument("--tls-ca", default=env("PDSERVE_TLS_CA"),
                        help="TLS, verifying the router against this PEM CA (env PDSERVE_TLS_CA)")
    parser.add_argument("--tls-client-cert", default=env("PDSERVE_TLS_CLIENT_CERT"),
                        help="PEM client certificate (env PDSERVE_TLS_CLIENT_CERT)")
    parser.add_argument("--tls-client-key", default=env("PDSERVE_TLS_CLIENT_KEY"),
                        help="PEM key of the client certificate (env PDSERVE_TLS_CLIENT_KEY)")


def connection_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`api_token` and `tls` for Client / AsyncClient; ValueError naming conflicting flags."""
    if args.api_token and args.api_token_file:
        raise ValueError("--api-token and --api-token-file are both set (or their PDSERVE_ "
                         "variables): give the token one way")
    token = read_token_file(args.api_token_file) if args.api_token_file else args.api_token
    wants_tls = args.tls or args.tls_ca or args.tls_client_cert or args.tls_client_key
    tls = ClientTLS(args.tls_ca, args.tls_client_cert, args.tls_client_key) if wants_tls else None
    return {"api_token": token or None, "tls": tls}
