"""Bearer-token authentication, shared by the gateway's front doors (gRPC here, HTTP beside it).

A caller authenticates with the header `authorization: Bearer <token>` (RFC 6750,
section 2.1; the scheme name is case-insensitive, RFC 7235 section 2.1). The
comparison is constant-time (`hmac.compare_digest`), so the time an answer takes
says nothing about how much of a guess was right. The token is
`GatewayConfig.auth_token` (`--auth-token`, `HYBRIDGATE_AUTH_TOKEN`, or
`--auth-token-file`); None means authentication is off.
"""

from __future__ import annotations

import hmac

SCHEME = "bearer"
HEADER = "authorization"  # gRPC metadata keys are lower case; HTTP's header is case-insensitive


def bearer_ok(expected_token: str | None, authorization: str | None) -> bool:
    """Whether `authorization` (the header's value, or None when absent) carries `expected_token`.

    True whenever `expected_token` is None or empty (authentication off). Otherwise the header
    must be `Bearer <token>` with exactly that token, compared in constant time.
    """
    if not expected_token:
        return True
    if authorization is None:
        return False
    scheme, _, presented = authorization.strip().partition(" ")
    if scheme.lower() != SCHEME:
        return False
    return hmac.compare_digest(presented.strip().encode("utf-8"), expected_token.encode("utf-8"))


def check_token(token: str) -> None:
    """A token fit for an HTTP header: printable ASCII without spaces.
    Raises ValueError saying so (never showing the token)."""
    if not all("!" <= ch <= "~" for ch in token):
        raise ValueError("must be printable ASCII without spaces (it travels in an HTTP header)")
