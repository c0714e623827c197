"""API tokens: who may call pdserve.v1 (and /v1/*), and whose sessions a call may touch.

Every pdserve.v1 call must carry `authorization: Bearer <token>` for one of the configured
tokens (several: one per client, from `api_token_file`). Health and reflection stay open
(load balancers and probes carry no token). A wrong or missing token is UNAUTHENTICATED
before the call reaches the router. Tokens are kept and compared as SHA-256 digests (in
constant time), so a token never sits in memory twice and timing says nothing of it.

Each token is a *tenant*: the short hash of its token namespaces that client's session ids
(`router.store`), so one client can neither read nor overwrite another's session by guessing
its id. Without tokens every caller is the one public tenant. Off when no token is configured.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence

from pdserve.redis_keys import PUBLIC_TENANT

OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
_TENANT_CHARS = 16  # 64 bits of the token's hash: unique per token, says nothing of it


def tenant_of(token: str) -> str:
    """The session namespace of one token."""
    return hashlib.sha256(token.encode()).hexdigest()[:_TENANT_CHARS]


class APITokens:
    """The accepted tokens; `tenant(authorization header)` is the caller's namespace or None."""

    def __init__(self, tokens: Iterable[str]) -> None:
        tokens = tuple(tokens)
        if not tokens or not all(tokens):
            raise ValueError("api tokens must be non-empty strings")
        self._digests = tuple((hashlib.sha256(t.encode()).digest(), tenant_of(t))
                              for t in tokens)

    @classmethod
    def of(cls, tokens: APITokens | str | Sequence[str] | None) -> APITokens | None:
        """None (open API) for None or no tokens; a single token or a list otherwise."""
        if tokens is None or isinstance(tokens, APITokens):
            return tokens
        tokens = (tokens,) if isinstance(tokens, str) else tuple(tokens)
        return cls(tokens) if tokens else None

    def tenant(self, authorization: str) -> str | None:
        """The tenant of `Bearer <token>` when the token is one of ours, else None."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for expected, tenant in self._digests:  # no early exit: every token costs the same
            if hmac.compare_digest(digest, expected):
                found = tenant
        return found


def call_tenant(tokens: APITokens | None, metadata) -> str | None:
    """The tenant of a gRPC call's metadata (PUBLIC_TENANT when the API is open)."""
    if tokens is None:
        return PUBLIC_TENANT
    given = dict(metadata or ()).get("authorization", "")
    return tokens.tenant(given) if isinstance(given, str) else None


def authorized(tokens: APITokens, method: str, metadata) -> bool:
    """Whether a call to `method` may go on: health and reflection are open, the rest need a
    token."""
    return method.startswith(OPEN_PREFIXES) or call_tenant(tokens, metadata) is not None
