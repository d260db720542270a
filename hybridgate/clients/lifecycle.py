"""A worker's lifecycle as a router sees it: an explicit state machine, pure (no sockets, no clock).

The states are `wire.WorkerState`. `hybridgate.router.client.ZmqWorkerClient`
feeds the events, from its socket (HELLO, READY, any other message), its
ticker (silence, probe due), its sends (a send that fails) and the router
(refused), and carries out the actions:

    state        event                              next         actions
    -----------  ---------------------------------  -----------  ------------------------------------
    CONNECTING   probe due (no HELLO yet)           CONNECTING   send CONNECT; backoff doubles, capped
    CONNECTING   HELLO, ready                       READY
    CONNECTING   HELLO, not ready (warming up)      CONNECTING   probes stop; READY follows
    CONNECTING   READY (after HELLO)                READY
    CONNECTING   silent > dead_after_s after HELLO  DEAD         report WorkerDead
    READY        any message                        READY        (liveness)
    READY        silent > suspect_after_s           SUSPECT
    READY        a send failed                      SUSPECT
    READY        silent > dead_after_s              DEAD         report WorkerDead; keep in-flight ids
    SUSPECT      any message                        READY
    SUSPECT      silent > dead_after_s              DEAD         report WorkerDead; keep in-flight ids
    READY/SUSPECT/CONNECTING after HELLO:
                 exited (its supervisor saw it)     DEAD         report WorkerDead at once
    DEAD         probe due                          PROBING      send CONNECT
    PROBING      probe due                          PROBING      send CONNECT; backoff doubles, capped
    DEAD/PROBING HELLO, same boot id (false death)  READY        send one ABORT of the kept ids
                                                    (CONNECTING if it is not ready)
    any          HELLO, new boot id (a new worker)  CONNECTING   report WorkerDead if it had sequences;
                                                                 new socket; send CONNECT
    any          refused (other model)              REFUSED      (terminal: every event is ignored)

"Report WorkerDead" is the one signal the router acts on for the streams on
this worker (fail them or resume them elsewhere). A new socket on a new boot
id drops whatever was queued for the old worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgate.wire import WorkerState

PROBE_FIRST_S = 0.05  # first CONNECT resend; doubles up to PROBE_MAX_S
PROBE_MAX_S = 0.5  # a restarted worker is found at most this long after it binds
MAX_ABANDONED = 4096  # request ids kept per worker to abort if it comes back after a false death


@dataclass(frozen=True)
class HelloSeen:
    boot_id: str
    ready: bool


@dataclass(frozen=True)
class ReadySeen:
    pass


@dataclass(frozen=True)
class MessageSeen:
    pass


@dataclass(frozen=True)
class Silence:
    seconds: float  # since the last valid message


@dataclass(frozen=True)
class ProbeDue:
    pass


@dataclass(frozen=True)
class SendFailed:
    reason: str


@dataclass(frozen=True)
class Refused:
    pass


@dataclass(frozen=True)
class Exited:
    reason: str  # the worker's process is known to have ended (serve's supervisor saw it)


LifecycleEvent = HelloSeen | ReadySeen | MessageSeen | Silence | ProbeDue | SendFailed | Refused | Exited


@dataclass(frozen=True)
class SendConnect:
    pass


@dataclass(frozen=True)
class SendAbort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class NewSocket:
    pass


@dataclass(frozen=True)
class ReportDead:
    reason: str
    boot_id: str


Action = SendConnect | SendAbort | NewSocket | ReportDead


class Lifecycle:
    """One worker's states as a router sees it (the table in this module's docstring).

    Pure: no sockets and no clock of its own; `on(event, now)` returns the
    actions for the client to carry out. `now` is `time.monotonic()` seconds.
    Also keeps the ids of the requests in flight on the worker (`started`,
    `finished`) so that, after a false death, the ones given up on are aborted.
    """

    def __init__(self, label: str, *, dead_after_s: float, suspect_after_s: float | None = None):
        if dead_after_s <= 0:
            raise ValueError(f"dead_after_s must be > 0, got {dead_after_s}")
        self.label = label
        self.dead_after_s = dead_after_s
        self.suspect_after_s = suspect_after_s if suspect_after_s is not None else dead_after_s / 2
        self.state = WorkerState.CONNECTING
        self.boot_id = ""  # of the worker this client talks to ("" before the first HELLO)
        self.hello_seen = False  # a HELLO from the current boot arrived
        self.next_probe_at = 0.0
        self._probe_interval = PROBE_FIRST_S
        self.inflight: dict[str, None] = {}  # ordered sets: request ids
        self.abandoned: dict[str, None] = {}
        self._handlers = {HelloSeen: self._on_hello, ReadySeen: self._on_ready, MessageSeen: self._on_message,
                          Silence: self._on_silence, ProbeDue: self._on_probe_due, SendFailed: self._on_send_failed,
                          Refused: self._on_refused, Exited: self._on_exited}

    @property
    def probing(self) -> bool:
        """Whether CONNECT is being resent (ask `on(ProbeDue())` once `now >= next_probe_at`)."""
        return (self.state == WorkerState.CONNECTING and not self.hello_seen) or \
            self.state in (WorkerState.DEAD, WorkerState.PROBING)

    def on(self, event: LifecycleEvent, now: float) -> list[Action]:
        if self.state == WorkerState.REFUSED:
            return []
        return self._handlers[type(event)](event, now)

    # --- request bookkeeping (what to abort after a false death) ---

    def started(self, request_id: str) -> None:
        self.inflight[request_id] = None

    def finished(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)

    # --- transitions ---

    def _on_hello(self, ev: HelloSeen, now: float) -> list[Action]:
        if self.boot_id and ev.boot_id != self.boot_id:
            return self._new_boot(ev, now)
        self.boot_id, self.hello_seen = ev.boot_id, True
        if self.state in (WorkerState.DEAD, WorkerState.PROBING):
            abandoned = tuple(self.abandoned)
            self.abandoned.clear()
            self.state = WorkerState.READY if ev.ready else WorkerState.CONNECTING
            return [SendAbort(abandoned)] if abandoned else []
        if ev.ready:
            self.state = WorkerState.READY
        return []

    def _new_boot(self, ev: HelloSeen, now: float) -> list[Action]:
        old = self.boot_id
        had = bool(self.inflight) and self.state in (WorkerState.CONNECTING, WorkerState.READY, WorkerState.SUSPECT)
        self.inflight.clear()
        self.abandoned.clear()
        self.boot_id, self.hello_seen = ev.boot_id, False
        self._enter_probing(WorkerState.CONNECTING, now)
        actions: list[Action] = []
        if had:
            actions.append(ReportDead(f"worker {self.label} restarted (boot {old[:8]} → {ev.boot_id[:8]}); "
                                      "its sequences are gone", old))
        return actions + [NewSocket()]

    def _on_ready(self, ev: ReadySeen, now: float) -> list[Action]:
        if self.state in (WorkerState.CONNECTING, WorkerState.SUSPECT) and self.hello_seen:
            self.state = WorkerState.READY
        return []

    def _on_message(self, ev: MessageSeen, now: float) -> list[Action]:
        if self.state == WorkerState.SUSPECT:
            self.state = WorkerState.READY
        return []

    def _on_silence(self, ev: Silence, now: float) -> list[Action]:
        live = self.state in (WorkerState.READY, WorkerState.SUSPECT) or \
            (self.state == WorkerState.CONNECTING and self.hello_seen)
        if live and ev.seconds > self.dead_after_s:
            return self._die(f"worker {self.label} silent for {ev.seconds:.1f} s", now)
        if self.state == WorkerState.READY and ev.seconds > self.suspect_after_s:
            self.state = WorkerState.SUSPECT
        return []

    def _on_send_failed(self, ev: SendFailed, now: float) -> list[Action]:
        if self.state == WorkerState.READY:
            self.state = WorkerState.SUSPECT
        return []

    def _on_probe_due(self, ev: ProbeDue, now: float) -> list[Action]:
        if not self.probing:
            return []
        if self.state == WorkerState.DEAD:
            self.state = WorkerState.PROBING
        self.next_probe_at = now + self._probe_interval
        self._probe_interval = min(self._probe_interval * 2, PROBE_MAX_S)
        return [SendConnect()]

    def _on_exited(self, ev: Exited, now: float) -> list[Action]:
        live = self.state in (WorkerState.READY, WorkerState.SUSPECT) or \
            (self.state == WorkerState.CONNECTING and self.hello_seen)
        return self._die(f"worker {self.label} exited ({ev.reason})", now) if live else []

    def _on_refused(self, ev: Refused, now: float) -> list[Action]:
        self.state = WorkerState.REFUSED
        return []

    def _die(self, reason: str, now: float) -> list[Action]:
        self.abandoned.update(self.inflight)
        self.inflight.clear()
        while len(self.abandoned) > MAX_ABANDONED:
            del self.abandoned[next(iter(self.abandoned))]
        self._enter_probing(WorkerState.DEAD, now)
        return [ReportDead(reason, self.boot_id)]

    def _enter_probing(self, state: WorkerState, now: float) -> None:
        self.state = state
        self.next_probe_at = now
        self._probe_interval = PROBE_FIRST_S
