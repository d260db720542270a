"""Errors the router raises; the gateway maps each to one gRPC status."""

from hybridgate.wire import InvalidFieldError


class RouterError(Exception):
    """Base of the router's errors."""


# A request field out of its limit (INVALID_ARGUMENT); `field` names it.
InvalidRequestError = InvalidFieldError


class UnavailableError(RouterError):
    """No worker can serve the request, or its worker died (UNAVAILABLE)."""


class WorkerRequestError(RouterError):
    """The worker failed the request (INTERNAL)."""


class ResourceExhaustedError(RouterError):
    """The worker ran out of (device) memory for the request (RESOURCE_EXHAUSTED)."""


class FingerprintMismatchError(RouterError):
    """A worker serves a different model than the router's."""
