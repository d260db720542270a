"""Errors the router raises; the gateway maps each to one gRPC status."""

from hybridgate.wire import InvalidFieldError


class RouterError(Exception):
    """Base of the router's errors."""


# A request field out of its limit (INVALID_ARGUMENT); `field` names it.
InvalidRequestError = InvalidFieldError


class ContextLengthError(InvalidFieldError):
    """The prompt, or the prompt and max_tokens, exceed the max model length (INVALID_ARGUMENT; the HTTP
    door's `context_length_exceeded`)."""


class UnavailableError(RouterError):
    """No worker can serve the request, or its worker died (UNAVAILABLE)."""


class WorkerRequestError(RouterError):
    """The worker failed the request (INTERNAL)."""


class ResourceExhaustedError(RouterError):
    """No worker had room for the request (RESOURCE_EXHAUSTED): `reason` is "worker_memory" (device or
    host memory, or KV blocks) or "worker_queue_full" (every worker's waiting queue was at --max-num-waiting)."""

    def __init__(self, message: str, reason: str = "worker_memory"):
        super().__init__(message)
        self.reason = reason


class DeadlineExceededError(RouterError):
    """The request's deadline is shorter than every plan's predicted TTFT, or passed while it waited on its
    worker; no work was done for it (DEADLINE_EXCEEDED)."""


class FingerprintMismatchError(RouterError):
    """A worker serves a different model than the router's."""
