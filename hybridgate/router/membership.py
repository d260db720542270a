"""A router's workers: who they are, which are usable, and health following readiness.

`Membership` holds the worker clients (those given at start, and those the
registry adds and drops while the router runs), refuses a worker that serves
another model (its HELLO's fingerprint), logs each lifecycle change, and calls
`on_ready_change(ready)` whenever "some worker is READY" flips, so the
gateway's health follows it both ways. The router's output pump calls
`changed()` after every message; start-up waits on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from hybridgate.clients.interface import StateChange, WorkerClient
from hybridgate.router.errors import FingerprintMismatchError, UnavailableError
from hybridgate.wire import Hello, WorkerState

log = logging.getLogger("hybridgate.router")


class Membership:
    """The worker clients of one router (`clients`, in the order given or added) and their readiness."""

    def __init__(self, clients: Iterable[WorkerClient], fingerprint: str,
                 on_ready_change: Callable[[bool], None] | None = None):
        self.clients: list[WorkerClient] = list(clients)
        self.fingerprint = fingerprint
        self.on_ready_change = on_ready_change or (lambda ready: None)
        self._was_ready = False
        self._changed = asyncio.Event()

    @property
    def ready(self) -> bool:
        """Whether some worker is READY."""
        return any(c.state == WorkerState.READY for c in self.clients)

    def add(self, client: WorkerClient) -> None:
        self.clients.append(client)

    def remove(self, client: WorkerClient) -> bool:
        """Forget `client`; False when it was not a member."""
        if client not in self.clients:
            return False
        self.clients.remove(client)
        return True

    def changed(self) -> None:
        """Something about the workers may have changed: wake the waiters, and tell health of a flip."""
        self._changed.set()
        if self.ready != self._was_ready:
            self._was_ready = self.ready
            self.on_ready_change(self._was_ready)

    def mismatch(self, client: WorkerClient) -> str:
        named = f" (its model: {client.hello.model})" if client.hello.model else ""
        return (f"worker {client.endpoint} serves model fingerprint {client.hello.fingerprint}, "
                f"but this router's model has fingerprint {self.fingerprint}{named}")

    def on_hello(self, client: WorkerClient, msg: Hello) -> None:
        """A worker serving another model is refused (REFUSED is terminal in its lifecycle)."""
        if msg.fingerprint != self.fingerprint:
            client.state = WorkerState.REFUSED
            log.error("refusing %s", self.mismatch(client))

    @staticmethod
    def on_state_change(client: WorkerClient, msg: StateChange) -> None:
        back = msg.new == WorkerState.READY and msg.old in (WorkerState.SUSPECT, WorkerState.DEAD, WorkerState.PROBING)
        # Losing a worker is a warning; so is getting it back, so that recovery shows at the default level.
        level = logging.INFO if msg.new in (WorkerState.READY, WorkerState.CONNECTING) and not back else logging.WARNING
        log.log(level, "%s worker %s: %s → %s", client.kind or "", getattr(client, "name", client.endpoint),
                msg.old.name, msg.new.name)

    async def wait_usable(self) -> None:
        """Until some worker is READY. Raises FingerprintMismatchError when every one was refused,
        UnavailableError when there is none. A dead worker may come back (restarted, or a false death),
        so only refused ones are given up on."""
        while not self.ready:
            if not self.clients:
                raise UnavailableError("no worker to wait for (none was given)")
            if all(c.state == WorkerState.REFUSED for c in self.clients):
                raise FingerprintMismatchError(self.mismatch(self.clients[0]))
            self._changed.clear()
            await self._changed.wait()

    async def wait_settled(self, timeout_s: float) -> None:
        """Wait until no worker is still CONNECTING (each READY, DEAD or REFUSED), at most timeout_s."""

        async def settled():
            while any(c.state == WorkerState.CONNECTING for c in self.clients):
                self._changed.clear()
                await self._changed.wait()

        try:
            await asyncio.wait_for(settled(), timeout_s)
        except asyncio.TimeoutError:
            pass
