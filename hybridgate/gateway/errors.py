"""The one table from the router's errors to the answers of both front doors: a gRPC status, and the
HTTP status and OpenAI error type of the same answer (DESIGN.md, "Errors and bad input")."""

from __future__ import annotations

import grpc

from hybridgate.router import (
    DeadlineExceededError,
    FingerprintMismatchError,
    ResourceExhaustedError,
    UnavailableError,
    WorkerRequestError,
)
from hybridgate.wire import InvalidFieldError

# (error, gRPC status, HTTP status, OpenAI error type); the first row an error is an instance of answers it.
TABLE: tuple[tuple[type[BaseException], grpc.StatusCode, int, str], ...] = (
    (InvalidFieldError, grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (FingerprintMismatchError, grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (WorkerRequestError, grpc.StatusCode.INTERNAL, 500, "server_error"),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
)
STATUS_OF: dict[type[BaseException], grpc.StatusCode] = {exc: code for exc, code, _, _ in TABLE}
ROUTER_ERRORS = tuple(STATUS_OF)

# gRPC status → (HTTP status, OpenAI error type), for the HTTP door's own answers too (404, 401).
HTTP_OF: dict[grpc.StatusCode, tuple[int, str]] = {
    **{code: (http, kind) for _, code, http, kind in TABLE},
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}

# A draining gateway's answer to a new generation request (gRPC UNAVAILABLE, HTTP 503 with Retry-After).
DRAINING = "the gateway is shutting down (SIGINT/SIGTERM) and takes no new requests; retry on another replica"
DRAINING_RETRY_S = 1  # the Retry-After: a load balancer in front has taken this replica out by then


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a router error (INTERNAL for anything outside the table)."""
    return next((code for t, code, _, _ in TABLE if isinstance(exc, t)), grpc.StatusCode.INTERNAL)
