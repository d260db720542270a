"""The gRPC port's security: the bearer-token interceptor and the TLS server credentials.

Every method but `grpc.health.v1.Health` needs the token (hybridgate.gateway.auth),
reflection and GetModelInfo included, so an unauthenticated caller learns neither
the API nor the workers' endpoints. A refusal is UNAUTHENTICATED before the
handler runs (no request is decoded, nothing is counted against admission).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from hybridgate.gateway.auth import HEADER, bearer_ok
from hybridgate.security.keys import read_secret_file

OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # load balancers probe health without a token
REFUSAL = "missing or wrong bearer token (send metadata `authorization: Bearer <token>`)"


async def _refuse(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers UNAUTHENTICATED."""
    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.unary_unary:
        async def unary_unary(request, context):
            await _refuse(context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **codec)
    if handler.unary_stream:
        async def unary_stream(request, context):
            await _refuse(context)
            yield  # an async generator, as the kind requires; never reached
        return grpc.unary_stream_rpc_method_handler(unary_stream, **codec)
    if handler.stream_unary:
        async def stream_unary(requests, context):
            await _refuse(context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **codec)

    async def stream_stream(requests, context):
        await _refuse(context)
        yield
    return grpc.stream_stream_rpc_method_handler(stream_stream, **codec)


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` but those to OPEN_SERVICES."""

    def __init__(self, token: str):
        self._token = token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        presented = next((v for k, v in details.invocation_metadata or () if k == HEADER), None)
        if isinstance(presented, bytes):
            presented = presented.decode("latin-1")
        return handler if bearer_ok(self._token, presented) else _refusing(handler)


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS credentials from PEM files: the certificate chain `cert`, its private key `key` (a
    secret file: mode 0600 or narrower) and, for mutual TLS, `client_ca`, the CA whose
    certificates clients must present (a client without one is refused in the handshake).
    Raises ValueError/OSError naming the flag (--tls-cert, --tls-key, --tls-client-ca)."""
    key_pem = read_secret_file(key, "--tls-key").encode()
    cert_pem = _read(cert, "--tls-cert")
    if b"-----BEGIN" not in cert_pem:
        raise ValueError(f"--tls-cert: {cert} is not a PEM certificate")
    ca_pem = _read(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=ca_pem,
                                       require_client_auth=ca_pem is not None)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
