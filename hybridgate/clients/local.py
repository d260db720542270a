"""Worker clients whose worker lives in this process (the in-process engine, test doubles): the same
`Lifecycle` as `ZmqWorkerClient` (hybridgate/clients/lifecycle.py), without a socket."""

from __future__ import annotations

import math
import time
import uuid

from hybridgate.clients.interface import MessageHandler, StateChange, WorkerDead
from hybridgate.clients.lifecycle import (
    Exited,
    HelloSeen,
    Lifecycle,
    LifecycleEvent,
    NewSocket,
    Refused,
    ReportDead,
    SendAbort,
    SendConnect,
)
from hybridgate.wire import Ready, WorkerState


class LocalWorkerClient:
    """Base of the clients whose worker lives in this process (the in-process engine, test doubles):
    the same `Lifecycle` as `ZmqWorkerClient`, fed what a process-local worker can say.

    `come_up()` is its HELLO and READY (a new boot id per client), `lost(reason)` its
    process's end (`Exited`: DEAD at once, WorkerDead to the router) and `back()` a HELLO of
    the same boot (a false death: READY again). There is no socket, so no silence and no probe:
    a lost local worker stays DEAD until `back()`. Subclasses set `endpoint`, `kind`, `hello`
    and `stats`, and call `_start_lifecycle(on_message)` from `start`.
    """

    def _start_lifecycle(self, on_message: MessageHandler) -> None:
        # No socket, so no silence: nothing ever feeds `Silence`, and no timeout could end a local worker.
        self.lifecycle = Lifecycle(getattr(self, "name", "") or self.endpoint, dead_after_s=math.inf)
        self.boot_id = uuid.uuid4().hex
        self._on_message = on_message
        self._actions = {SendConnect: lambda a: None, NewSocket: lambda a: None,
                         SendAbort: lambda a: self.abort(list(a.request_ids)),
                         ReportDead: lambda a: on_message(self, WorkerDead(a.reason, a.boot_id))}

    @property
    def state(self) -> WorkerState:
        lifecycle = getattr(self, "lifecycle", None)
        return lifecycle.state if lifecycle is not None else WorkerState.CONNECTING

    @state.setter
    def state(self, state: WorkerState) -> None:
        if state != WorkerState.REFUSED:
            raise ValueError(f"only REFUSED is set from outside the lifecycle, got {state.name}")
        self._event(Refused())

    def come_up(self) -> None:
        """The worker's HELLO (ready) and READY, as a socket would bring them."""
        self._on_message(self, self.hello)  # first: the router refuses a worker with another model
        self._event(HelloSeen(self.boot_id, ready=True))
        self._on_message(self, Ready(self.kind))

    def lost(self, reason: str) -> None:
        """The worker is gone (its thread or task ended): DEAD, and WorkerDead for its streams."""
        self._event(Exited(reason))

    def back(self) -> None:
        """The same worker answers again (a false death): READY."""
        self._event(HelloSeen(self.boot_id, ready=True))

    def _event(self, event: LifecycleEvent) -> None:
        old = self.state
        for action in self.lifecycle.on(event, time.monotonic()):
            self._actions[type(action)](action)
        if self.state != old:
            self._on_message(self, StateChange(old, self.state))
