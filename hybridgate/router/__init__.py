"""The embeddable Router: tokenize, detokenize, stop strings, placement, registry, response cache.

Never imports torch, numba or `hybridgate.workers`; worker clients are handed in.
The names below load their module on first use (PEP 562), so importing the
router's settings (`hybridgate.router.config`) loads none of its behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_HOMES = {
    "hybridgate.clients.interface": ("WorkerClient", "WorkerDead"),
    "hybridgate.router.client": ("ZmqWorkerClient",),
    "hybridgate.router.config": ("RouterConfig",),
    "hybridgate.router.errors": ("DeadlineExceededError", "FingerprintMismatchError", "InvalidRequestError",
                                 "ResourceExhaustedError", "RouterError", "UnavailableError", "WorkerRequestError"),
    "hybridgate.router.router": ("ROUTES", "Router"),
    "hybridgate.router.deltas": ("Delta", "Timings", "Usage"),
    "hybridgate.router.stream": ("GenerationStream",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)

if TYPE_CHECKING:
    from hybridgate.clients.interface import WorkerClient, WorkerDead
    from hybridgate.router.client import ZmqWorkerClient
    from hybridgate.router.config import RouterConfig
    from hybridgate.router.errors import (
        DeadlineExceededError,
        FingerprintMismatchError,
        InvalidRequestError,
        ResourceExhaustedError,
        RouterError,
        UnavailableError,
        WorkerRequestError,
    )
    from hybridgate.router.router import ROUTES, Router
    from hybridgate.router.deltas import Delta, Timings, Usage
    from hybridgate.router.stream import GenerationStream


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridgate.router' has no attribute {name!r}")
    # __import__, not importlib.import_module: the latter bypasses the interpreter's import statement,
    # so `python -X importtime` would not list the modules it loads.
    value = getattr(__import__(module, fromlist=(name,)), name)
    globals()[name] = value  # the next lookup skips this function
    return value
