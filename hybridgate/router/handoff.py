"""The router's side of the gpu->cpu KV hand-off: one request's state machine, its reorder
buffer, the test-only pause hook and the router-side metrics.

The router owns the request's state (DESIGN.md, "KV hand-off"; the workers'
side of each message is described in `hybridgate.wire`, "KV hand-off messages").
G is the GPU worker, C the CPU worker; "lost" is a `WorkerDead` from the
client (silent past the liveness timeout) or a token gap that does not fill
within the stall timeout; "lost → stream" hands the stream a `WorkerDead`, so
it is retried or resumed elsewhere by re-prefill, as any lost worker's stream.

    state            event                          action                               next
    ---------------  -----------------------------  -----------------------------------  ---------------
    RESERVING        C: reservation ok              Add(handoff=C's endpoint, token) → G  PREFILLING
    RESERVING        C: reservation refused;        Add → G (plain); outcome refused      ON_GPU
                     C lost
    RESERVING        G lost                         Abort → C; lost → stream             CLOSED
    RESERVING        no answer within answer_s      Add → G (plain); outcome refused      ON_GPU
    PREFILLING       G: exported                    clock starts                         EXPORTED
                     (C refused or lost before it:  Resume → G, Abort → C;               ON_GPU)
                                                    outcome resumed
    PREFILLING       G: export failed               Abort → C (frees the reservation);   ON_GPU
                                                    outcome refused (not when finished)
    PREFILLING       C: refused; C lost             wait for G's exported/export failed  PREFILLING
    PREFILLING       C: imported (its message can   as if G had said exported, then      EXPORTED →
                     overtake G's exported)         the import (below)                    IMPORTED
    EXPORTED         C: imported                    clock stops; outcome done            IMPORTED
    PREFILLING       G lost                         Abort → C; lost → stream             CLOSED
    EXPORTED         C: refused; C lost; no answer  Resume → G, Abort → C;               ON_GPU
                     within answer_s                outcome resumed
                     (G lost before it:             lost → stream                        CLOSED)
    EXPORTED         G lost                         remember it (C may still import)     EXPORTED
    IMPORTED         (at once, or after a pause)    Release → G; the stream's worker      DECODING_ON_CPU
                                                    becomes C
    IMPORTED,        C lost                         Release → G; lost → stream           CLOSED
      DECODING_ON_CPU
    ON_GPU           G lost                         lost → stream                        CLOSED
    any but CLOSED   abort (client gone, stop       Abort → G and C (idempotent);        CLOSED
                     string, error)                 outcome aborted before IMPORTED
    any but CLOSED   the stream finished            Abort → C while its reservation      CLOSED
                                                    may live
    any              output from G or C             reorder buffer → stream              (same)

Outputs of the request are accepted from both workers in every state: each
carries its token index, the `Reorder` buffer passes them on in order, drops
duplicates and reports a gap that does not fill within `stall_s`. C's outputs
count only once the router has confirmed its import (they wait until then, and
are dropped if the hand-off is resumed on G instead), so a stream never mixes
ids C sampled with ids a resumed G samples for the same indexes. A CPU worker
that is alive but does not answer (a reservation or an import) within
`answer_s` counts as refusing; the timer starts once a state's pause ended.
Control events that arrive while a state's pause hook holds it wait for the
pause to end; losses and aborts never wait.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from hybridgate.config import environment
from hybridgate.clients.interface import WorkerClient, WorkerDead
from hybridgate.router.handoff_metrics import HandoffMetrics
from hybridgate.router.reorder import Reorder
from hybridgate.wire import (
    AddRequest,
    HandoffExported,
    HandoffExportFailed,
    HandoffImported,
    HandoffRefused,
    HandoffRelease,
    HandoffReservation,
    HandoffReserve,
    HandoffResume,
    HandoffTarget,
    RequestError,
    SeqOutput,
)

log = logging.getLogger("hybridgate.router")

PAUSE_ENV = "HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE"


class HandoffState(enum.IntEnum):
    RESERVING = 1  # HandoffReserve sent to C; nothing sent to G yet
    PREFILLING = 2  # Add(handoff=...) sent to G; it prefills, streams token 0, exports
    EXPORTED = 3  # G sent the KV and parked the sequence; C imports
    IMPORTED = 4  # C confirmed; Release to G is due
    DECODING_ON_CPU = 5  # G released; C owns the sequence
    ON_GPU = 6  # refused, export failed or resumed: an ordinary gpu request from here
    CLOSED = 7  # finished, aborted or handed to the stream as lost


def worker_name(client: WorkerClient | None) -> str:
    """The label of a worker in routes and logs: its HELLO name, else its endpoint ("none": no worker)."""
    if client is None:
        return "none"
    hello = getattr(client, "hello", None)
    return (hello.name if hello is not None and hello.name else "") or client.endpoint


# --- the test-only pause hook ------------------------------------------------------


@dataclass(frozen=True)
class PauseHook:
    """Holds a hand-off in chosen states so tests reach each window on purpose.

    From `HYBRIDGATE_TEST_ROUTER_HANDOFF_PAUSE="STATES:MAX_SECONDS[:SEED]"`, STATES
    being `+`-separated state names (RESERVING, PREFILLING, EXPORTED, IMPORTED)
    or `all`: each hand-off entering one of them stays there for a seeded
    random time in [MAX_SECONDS / 2, MAX_SECONDS] before its next transition.
    Test-only: production leaves the variable unset (no pause).
    """

    states: frozenset[HandoffState] = frozenset()
    max_s: float = 0.0
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PauseHook:
        """From `environ` (tests), else the process's environment. Raises ValueError naming the variable
        when its value does not parse."""
        text = environ.get(PAUSE_ENV, "") if environ is not None else environment(PAUSE_ENV, "")
        if not text:
            return cls()
        parts = text.split(":")
        try:
            names = ("RESERVING", "PREFILLING", "EXPORTED", "IMPORTED") if parts[0] == "all" else parts[0].split("+")
            states = frozenset(HandoffState[n] for n in names)
            max_s, seed = float(parts[1]), int(parts[2]) if len(parts) > 2 else 0
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"{PAUSE_ENV}: expected STATES:MAX_SECONDS[:SEED] (STATES like EXPORTED+IMPORTED "
                             f"or all), got {text!r}") from None
        if max_s < 0:
            raise ValueError(f"{PAUSE_ENV}: MAX_SECONDS must be >= 0, got {max_s}")
        return cls(states, max_s, seed, random.Random(seed))

    def seconds(self, state: HandoffState) -> float:
        if state not in self.states or self.max_s <= 0:
            return 0.0
        return self.max_s * (0.5 + 0.5 * self.rng.random())


# --- router-side metrics ----------------------------------------------------------


# --- the state machine -------------------------------------------------------------


class LoopClock:
    """The running event loop's clock (`time.monotonic` on asyncio's loops) and its timers: a `Handoff`'s
    default. Tests hand in a clock of their own with the same two methods and advance it by hand."""

    def now(self) -> float:
        """Seconds, monotonic."""
        return asyncio.get_running_loop().time()

    def call_later(self, delay_s: float, callback: Callable, *args) -> asyncio.TimerHandle:
        """Run `callback(*args)` once `delay_s` seconds have passed; the handle's `cancel()` stops it."""
        return asyncio.get_running_loop().call_later(delay_s, callback, *args)


class HandoffSink(Protocol):
    """What the hand-off needs of its stream."""

    request_id: str

    def put(self, item) -> None: ...  # an in-order SeqOutput, a RequestError or a WorkerDead

    def moved(self, old: WorkerClient, new: WorkerClient) -> None: ...  # the decoding worker changed


class Handoff:
    """One gpu->cpu request's hand-off (the table is in the module docstring).

    `request` is the AddRequest the GPU worker gets (without a target; one is
    added once the CPU worker reserved). Every method runs on the router's
    event loop; `on_message` takes the messages of both workers for this request.
    `clock` times its timers (stall, answer, pauses) and the export-to-import
    seconds: the loop's own (`LoopClock`) unless a test hands in one it advances.
    """

    def __init__(self, sink: HandoffSink, request: AddRequest, gpu: WorkerClient, cpu: WorkerClient,
                 metrics: HandoffMetrics, pause: PauseHook, stall_s: float, answer_s: float = 10.0,
                 clock: LoopClock | None = None):
        self.sink, self.request, self.gpu, self.cpu = sink, request, gpu, cpu
        self.metrics, self.pause, self.stall_s, self.answer_s = metrics, pause, stall_s, answer_s
        self.clock = clock or LoopClock()
        self.state = HandoffState.RESERVING
        self.reorder = Reorder(request.first_token_index)
        self.note = ""  # why it ran on the GPU, for the route
        self.imported = False  # C confirmed the import: it decodes from token 1 on
        self._cpu_failed: str | None = None  # C refused or was lost while G prefilled
        self._gpu_lost = False
        self._export_started: float | None = None  # self.clock's, from G's HandoffExported
        self._export_bytes = 0  # K and V bytes G sent (HandoffExported.nbytes)
        self._imported_at: float | None = None  # set when C's confirmation came before G's HandoffExported
        self._early: list[SeqOutput] = []  # C's outputs before its import was confirmed here
        self._held: list[tuple[WorkerClient, msgspec.Struct]] | None = None  # control events during a pause
        self._gap_timer: asyncio.TimerHandle | None = None
        self._answer_timer: asyncio.TimerHandle | None = None
        self._handlers: dict[type, Callable] = {
            HandoffReservation: self._on_reservation, HandoffExported: self._on_exported,
            HandoffExportFailed: self._on_export_failed, HandoffImported: self._on_imported,
            HandoffRefused: self._on_refused,
        }

    # --- driven by the stream ---------------------------------------------------

    def start(self) -> None:
        """Ask the CPU worker for a reservation (prompt + 1 KV slots)."""
        self.cpu.send(HandoffReserve(self.request.request_id, len(self.request.prompt_ids) + 1))
        self._enter(HandoffState.RESERVING)

    @property
    def active(self) -> bool:
        return self.state != HandoffState.CLOSED

    def involves(self, client: WorkerClient) -> bool:
        return client is self.gpu or client is self.cpu

    def abort(self) -> None:
        """Abort on both workers (idempotent on each); the hand-off is over."""
        if self.state == HandoffState.CLOSED:
            return
        if self.state < HandoffState.IMPORTED:
            self._count("aborted")
        log.info("hand-off %s aborted in %s", self.request.request_id, self.state.name)
        self._close()
        for client in (self.gpu, self.cpu):
            client.abort([self.request.request_id])

    def finished(self) -> None:
        """The stream ended normally: whatever either worker may still hold of it is freed
        (a reservation, a parked sequence whose release a pause held back)."""
        if self.state not in (HandoffState.DECODING_ON_CPU, HandoffState.CLOSED):
            for client in (self.gpu, self.cpu):
                client.abort([self.request.request_id])
        self._close()

    def route(self) -> str:
        g, c = worker_name(self.gpu), worker_name(self.cpu)
        if self.imported:
            return f"gpu->cpu ({g} -> {c})"
        return f"gpu ({self.note}; {g})" if self.note else f"gpu ({g})"

    # --- driven by the router's output pump -------------------------------------

    def on_message(self, client: WorkerClient, msg: msgspec.Struct) -> None:
        if not self.involves(client):
            return
        if isinstance(msg, SeqOutput) and client is self.cpu and not self.imported:
            if self.state in (HandoffState.PREFILLING, HandoffState.EXPORTED):
                self._early.append(msg)  # C decodes already; the router has not confirmed its import yet
        elif isinstance(msg, SeqOutput):
            self._on_output(msg)
        elif isinstance(msg, WorkerDead):
            self._on_lost(client, msg)
        elif isinstance(msg, RequestError):
            self.sink.put(msg)
        elif self._held is not None:
            self._held.append((client, msg))
        elif self.state != HandoffState.CLOSED:
            self._handlers[type(msg)](client, msg)

    def _on_output(self, out: SeqOutput) -> None:
        for ready in self.reorder.push(out):
            self.sink.put(ready)
        if self.reorder.gap_since is not None and self._gap_timer is None:
            self._gap_timer = self.clock.call_later(self.stall_s, self._on_stall)
        elif self.reorder.gap_since is None and self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None

    def _on_stall(self) -> None:
        self._gap_timer = None
        if self.reorder.gap_since is None:
            return
        decoder = self._decoder()
        reason = (f"tokens from index {self.reorder.next_index} of request {self.request.request_id} did not "
                  f"arrive within the stall timeout ({self.stall_s:g} s)")
        self._lost(decoder, WorkerDead(reason))

    # --- control events ----------------------------------------------------------

    def _on_reservation(self, client: WorkerClient, msg: HandoffReservation) -> None:
        if client is not self.cpu or self.state != HandoffState.RESERVING:
            return
        if not msg.ok:
            self._run_on_gpu(f"hand-off refused: {msg.reason}", "refused", add=True)
            return
        endpoint = self.cpu.hello.handoff_endpoint if self.cpu.hello is not None else ""
        target = HandoffTarget(endpoint, msg.token)
        self.gpu.add(msgspec.structs.replace(self.request, handoff=target))
        self._enter(HandoffState.PREFILLING)

    def _on_exported(self, client: WorkerClient, msg: HandoffExported) -> None:
        if client is not self.gpu:
            return
        # G sends this once the KV send is queued, so the export started export_ms before.
        self._export_started, self._export_bytes = self.clock.now() - msg.export_ms / 1e3, msg.nbytes
        if self._imported_at is not None:  # C's confirmation overtook this message
            self.metrics.observe(max(0.0, self._imported_at - self._export_started), msg.nbytes)
        if self.state != HandoffState.PREFILLING:
            return
        if self._cpu_failed is not None:
            self._resume(self._cpu_failed)
            return
        self._enter(HandoffState.EXPORTED)

    def _on_export_failed(self, client: WorkerClient, msg: HandoffExportFailed) -> None:
        if client is not self.gpu or self.state != HandoffState.PREFILLING:
            return
        self.cpu.abort([self.request.request_id])
        if msg.reason == "finished":
            self.note = ""
            self._enter(HandoffState.ON_GPU)
        else:
            self._run_on_gpu(f"hand-off export failed: {msg.reason}", "refused", add=False)

    def _on_imported(self, client: WorkerClient, msg: HandoffImported) -> None:
        if client is not self.cpu or self.state not in (HandoffState.PREFILLING, HandoffState.EXPORTED):
            return
        if self.state == HandoffState.PREFILLING:  # the KV was evidently exported: that state first
            self._enter(HandoffState.EXPORTED)
            if self._held is not None:  # EXPORTED's pause holds the import, as it would have
                self._held.append((client, msg))
                return
        if self._export_started is not None:
            self.metrics.observe(self.clock.now() - self._export_started, self._export_bytes)
        else:
            self._imported_at = self.clock.now()
        self._count("done")
        self.imported = True
        early, self._early = self._early, []
        for out in early:
            self._on_output(out)
        self._enter(HandoffState.IMPORTED, then=self._release)

    def _on_refused(self, client: WorkerClient, msg: HandoffRefused) -> None:
        if client is not self.cpu:
            return
        self._cpu_side_failed(f"hand-off refused: {msg.field}: {msg.message}")

    def _on_lost(self, client: WorkerClient, msg: WorkerDead) -> None:
        if self.state == HandoffState.CLOSED:
            return
        if client is self.cpu and self.state in (HandoffState.RESERVING, HandoffState.PREFILLING,
                                                 HandoffState.EXPORTED):
            if self.state == HandoffState.RESERVING:
                self._run_on_gpu(f"hand-off refused: CPU worker {worker_name(self.cpu)} lost", "refused", add=True)
            else:
                self._cpu_side_failed(f"hand-off resumed: CPU worker {worker_name(self.cpu)} lost")
        elif client is self.gpu and self.state == HandoffState.EXPORTED:
            self._gpu_lost = True
        elif client is self._decoder() or (client is self.gpu and self.state < HandoffState.EXPORTED):
            self._lost(client, msg)

    # --- actions -----------------------------------------------------------------

    def _cpu_side_failed(self, why: str) -> None:
        if self.state == HandoffState.PREFILLING:
            self._cpu_failed = why  # G has not said it exported: Resume waits for HandoffExported
        elif self.state == HandoffState.EXPORTED:
            if self._gpu_lost:
                self._lost(self.gpu, WorkerDead(f"{why}, and GPU worker {worker_name(self.gpu)} was lost"))
            else:
                self._resume(why)

    def _resume(self, why: str) -> None:
        self._early = []  # whatever C sampled is not this stream's: G samples those indexes again
        self.gpu.send(HandoffResume(self.request.request_id))
        self.cpu.abort([self.request.request_id])  # whatever C still holds of it (a late import, a reservation)
        self._count("resumed")
        self.note = why
        self._enter(HandoffState.ON_GPU)

    def _run_on_gpu(self, why: str, outcome: str, add: bool) -> None:
        if add:
            self.gpu.add(self.request)
        self._count(outcome)
        self.note = why
        self._enter(HandoffState.ON_GPU)

    def _release(self) -> None:
        self.gpu.send(HandoffRelease(self.request.request_id))
        self._enter(HandoffState.DECODING_ON_CPU)
        self.sink.moved(self.gpu, self.cpu)

    def _lost(self, client: WorkerClient, msg: WorkerDead) -> None:
        """The stream resumes elsewhere by re-prefill; neither worker keeps anything of it."""
        if self.state == HandoffState.IMPORTED:  # the release a pause held back; the stream's worker is C
            self.gpu.send(HandoffRelease(self.request.request_id))
            self.sink.moved(self.gpu, self.cpu)
        if self.state < HandoffState.IMPORTED:
            self._count("aborted")
        log.info("hand-off %s lost %s in %s: %s", self.request.request_id, worker_name(client), self.state.name,
                 msg.reason)
        for other in (self.gpu, self.cpu):
            if other is not client:
                other.abort([self.request.request_id])
        self._close()
        self.sink.put(msg)

    def _decoder(self) -> WorkerClient:
        return self.cpu if self.state in (HandoffState.IMPORTED, HandoffState.DECODING_ON_CPU) else self.gpu

    def _count(self, outcome: str) -> None:
        self.metrics.outcomes[outcome] += 1

    def _close(self) -> None:
        self.state = HandoffState.CLOSED
        self._held = None
        self._early = []
        for timer in (self._gap_timer, self._answer_timer):
            if timer is not None:
                timer.cancel()
        self._gap_timer = self._answer_timer = None

    def _arm_answer_timer(self) -> None:
        """RESERVING and EXPORTED wait on the CPU worker; one that stays silent counts as refusing."""
        if self._answer_timer is not None:
            self._answer_timer.cancel()
            self._answer_timer = None
        if self.state in (HandoffState.RESERVING, HandoffState.EXPORTED):
            self._answer_timer = self.clock.call_later(self.answer_s, self._on_no_answer, self.state)

    def _on_no_answer(self, state: HandoffState) -> None:
        self._answer_timer = None
        if self.state != state or self._held is not None:
            return
        why = f"CPU worker {worker_name(self.cpu)} did not answer within {self.answer_s:g} s"
        if state == HandoffState.RESERVING:
            self.cpu.abort([self.request.request_id])
            self._run_on_gpu(f"hand-off refused: {why}", "refused", add=True)
        else:
            self._cpu_side_failed(f"hand-off resumed: {why}")

    def _enter(self, state: HandoffState, then: Callable[[], None] | None = None) -> None:
        """Set the state; run `then` now, or after the state's pause (control events wait with it)."""
        log.info("hand-off %s: %s", self.request.request_id, state.name)
        self.state = state
        if self._held is not None:  # a loss left a paused state early: its held events meet the new state
            held, self._held = self._held, None
            loop = asyncio.get_running_loop()
            for client, msg in held:
                loop.call_soon(self.on_message, client, msg)
        hold = self.pause.seconds(state)
        if hold <= 0:
            self._arm_answer_timer()
            if then is not None:
                then()
            return
        self._held = []
        self.clock.call_later(hold, self._end_pause, state, then)

    def _end_pause(self, state: HandoffState, then: Callable[[], None] | None) -> None:
        if self.state != state or self._held is None:
            return  # aborted or lost during the pause
        held, self._held = self._held, None
        self._arm_answer_timer()
        if then is not None:
            then()
        for client, msg in held:
            self.on_message(client, msg)
