"""What a router needs of a worker client (`WorkerClient`) and the two events a client tells it of besides
the worker's own messages (`WorkerDead`, `StateChange`).

Below the router and the workers: `hybridgate.router.client.ZmqWorkerClient` implements the interface over
a socket, `hybridgate.workers.inprocess.InProcessClient` (through `hybridgate.clients.local`) over a thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from hybridgate.wire import AddRequest, EngineStats, Hello, WorkerState


class WorkerDead(msgspec.Struct, frozen=True):
    """Synthetic event: the worker's sequences are gone (silent past the liveness timeout, or it
    came back with a new boot id). The one signal the router acts on for the streams on it."""

    reason: str
    boot_id: str = ""  # the boot whose sequences are gone ("" when unknown)


class StateChange(msgspec.Struct, frozen=True):
    """Synthetic event: the client's lifecycle state changed (the router logs it, health follows)."""

    old: WorkerState
    new: WorkerState


# on_message(client, message): message is a wire Struct, WorkerDead or StateChange.
MessageHandler = Callable[["WorkerClient", msgspec.Struct], None]


class WorkerClient(Protocol):
    """What the router needs of a worker. Every client runs its states as a
    `hybridgate.clients.lifecycle.Lifecycle` (`ZmqWorkerClient` over a socket,
    `hybridgate.clients.local.LocalWorkerClient` for a worker in this process) and tells the router
    of each change (StateChange) and loss (WorkerDead); the router sets one state itself, REFUSED,
    on a HELLO with another model."""

    endpoint: str
    kind: str | None
    state: WorkerState
    stats: EngineStats
    hello: Hello | None

    async def start(self, on_message: MessageHandler) -> None: ...

    def add(self, request: AddRequest) -> bool | None: ...  # False: not sent (place it elsewhere)

    def abort(self, request_ids: list[str]) -> None: ...

    def send(self, msg: msgspec.Struct) -> None: ...  # KV hand-off messages (HandoffReserve, Release, Resume)

    async def close(self) -> None: ...
