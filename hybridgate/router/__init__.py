"""The embeddable Router: tokenize, detokenize, stop strings, placement, registry, response cache.

Never imports torch, numba or `hybridgate.workers`; worker clients are handed in.
"""

from hybridgate.router.client import WorkerClient, WorkerDead, ZmqWorkerClient
from hybridgate.router.errors import (
    DeadlineExceededError,
    FingerprintMismatchError,
    InvalidRequestError,
    ResourceExhaustedError,
    RouterError,
    UnavailableError,
    WorkerRequestError,
)
from hybridgate.router.router import ROUTES, Router, RouterConfig
from hybridgate.router.stream import Delta, GenerationStream, Timings, Usage

__all__ = [
    "ROUTES", "DeadlineExceededError", "Delta", "FingerprintMismatchError", "GenerationStream", "InvalidRequestError", "ResourceExhaustedError", "Router",
    "RouterConfig", "RouterError", "Timings", "UnavailableError", "Usage", "WorkerClient", "WorkerDead",
    "WorkerRequestError", "ZmqWorkerClient",
]
