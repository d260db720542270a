"""The worker side of the KV hand-off (gpu->cpu): reservations, the engine's hand-offs, test pauses (the
receiver's header and frame checks are `handoff_checks`).

No torch and no numba here: the torch runner's export lives in
`hybridgate.workers.gpu.export`, the Numba runner's import in
`NumbaRunner.import_kv`; the engine (`hybridgate.workers.engine`) drives both.
The messages and who sends them when are in `hybridgate.wire` ("KV hand-off
messages").

On the hand-off socket a hand-off is one HANDOFF_KV message (the header, no
KV frames) followed by HANDOFF_KV_PART messages, each carrying whole layers
(K then V per layer) as `HandoffPart` plus its frames, in layer order. Only
the layers that own K/V are sent (`KVLayout`), each in its own shape (gemma4's
differ by layer); a layer sharing another's K/V reads what its source imported.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridgate.config import environment
from hybridgate.wire import (
    ROPE_BASIS, HandoffExported, HandoffExportFailed, HandoffHeader, HandoffImported, HandoffOutcome, HandoffPart,
    HandoffRefused, HandoffRelease, HandoffReservation, HandoffReserve, HandoffResume, MsgType,
)
from hybridgate.workers.config import WorkerConfig
from hybridgate.workers.handoff_checks import (
    HandoffRefusal, KVSpec, check_header, decode_header, decode_part, frames_to_float32, imported_request,
)
from hybridgate.workers.sequence import SequenceStatus

log = logging.getLogger("hybridgate.worker")

@dataclass
class Reservation:
    """Blocks a CPU worker holds for a hand-off it was promised (unscheduled)."""

    client: bytes  # the router that reserved: refusals, confirmation and outputs go there
    request_id: str
    token: str
    num_tokens: int
    block_table: list[int]
    deadline: float  # time.monotonic()
    header: HandoffHeader | None = None  # set once the header is accepted
    next_layer: int = 0  # layers imported so far
    started: float = 0.0  # monotonic time the header arrived
    nbytes: int = 0
    write_s: float = 0.0  # converting and writing the KV into the cache


@dataclass
class Reservations:
    """Live reservations by request id (ids are the router's: unique per request)."""

    timeout_s: float = WorkerConfig.handoff_reservation_timeout_s
    by_id: dict[str, Reservation] = field(default_factory=dict)

    def add(self, client: bytes, request_id: str, num_tokens: int, table: list[int]) -> Reservation:
        r = Reservation(client, request_id, secrets.token_hex(16), num_tokens, table, time.monotonic() + self.timeout_s)
        self.by_id[request_id] = r
        return r

    def match(self, request_id: str, token: str) -> Reservation:
        """The live reservation `token` was issued for.

        Raises:
            HandoffRefusal("token", ...): no live reservation for the id, or another token.
        """
        r = self.by_id.get(request_id)
        if r is None or not secrets.compare_digest(r.token.encode(), token.encode()):
            raise HandoffRefusal("token", f"no live reservation of request {request_id!r} has this token "
                                 "(wrong, spent or expired)")
        return r

    def expired(self, now: float) -> list[Reservation]:
        return [r for r in self.by_id.values() if r.deadline <= now]


class PauseHooks:
    """Test-only pauses at named hand-off states, from HYBRIDGATE_TEST_HANDOFF_PAUSE.

    Format: `state:seconds[,state:seconds...]`, e.g. `exporting:0.5,imported:0.2`.
    With HYBRIDGATE_TEST_HANDOFF_PAUSE_SEED set, each pause lasts a uniform
    fraction of its seconds drawn from a `random.Random(seed)`, so a test picks
    the window by the state and the moment by the seed. Worker states:
    `reserved` (CPU, before answering HandoffReserve), `exporting` (GPU, before
    the KV is sent), `exported` (GPU, before HandoffExported), `importing` (CPU,
    before the KV is imported), `imported` (CPU, before HandoffImported).
    Unset (production): `pause()` returns at once. `sleep` is injected so a
    test can record the pauses instead of timing them.
    """

    STATES = ("reserved", "exporting", "exported", "importing", "imported")

    def __init__(self, spec: str | None = None, seed: str | None = None, sleep: Callable[[float], None] = time.sleep):
        self.sleep = sleep
        spec = environment("HYBRIDGATE_TEST_HANDOFF_PAUSE", "") if spec is None else spec
        seed = environment("HYBRIDGATE_TEST_HANDOFF_PAUSE_SEED") if seed is None else seed
        self.seconds: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            state, _, secs = item.partition(":")
            if state not in self.STATES:
                raise ValueError(f"HYBRIDGATE_TEST_HANDOFF_PAUSE: unknown state {state!r}, one of {self.STATES}")
            self.seconds[state] = float(secs)
        self._rng = random.Random(int(seed)) if seed else None
        self._lock = threading.Lock()

    def pause(self, state: str) -> None:
        secs = self.seconds.get(state)
        if not secs:
            return
        if self._rng is not None:
            with self._lock:
                secs *= self._rng.random()
        log.info("test pause: %s for %.3f s", state, secs)
        self.sleep(secs)


@dataclass
class ExportJob:
    """One sequence's export: where, what, and the event after which its blocks are final."""

    key: tuple[bytes, str]  # (router identity, request id) on the GPU worker
    endpoint: str
    header: HandoffHeader
    block_table: list[int]
    ready: object = None  # torch.cuda.Event on CUDA
    started: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)


# --- the engine's side ---------------------------------------------------------


@dataclass(frozen=True)
class HandoffConfig:
    """The worker's hand-off settings (from WorkerConfig)."""

    cache_imported_kv: bool = WorkerConfig.cache_imported_kv  # the defaults are the settings'
    reservation_timeout_s: float = WorkerConfig.handoff_reservation_timeout_s


@dataclass
class HandoffIncoming:
    """A message from the hand-off socket, as the I/O thread received it (frames not copied)."""

    kind: bytes  # MsgType.HANDOFF_KV or HANDOFF_KV_PART
    body: object
    frames: list


@dataclass
class Parked:
    """A GPU worker's exported sequence: blocks held, not scheduled, until release, resume or abort."""

    seq: object
    job: object
    copying: bool = True  # the exporter may still read its blocks
    pending: str = ""  # "release", "resume" or "abort", applied once copying ends
    refused: bool = False  # a refusal was already forwarded to the router


class EngineHandoffs:
    """Everything hand-off in one engine: parked exports (GPU worker), reservations and
    imports (CPU worker), the messages to send, and the counters.

    Runs on the engine thread only. Parked sequence states (GPU worker):

    | state    | event                        | next     | action                                   |
    |----------|------------------------------|----------|------------------------------------------|
    | running  | first token sampled          | copying  | park, submit the export                  |
    | copying  | export sent                  | parked   | HandoffExported to the router            |
    | copying  | export failed                | running  | unpark, HandoffExportFailed              |
    | copying  | release / resume / abort     | copying  | remembered, applied when copying ends    |
    | parked   | HandoffRelease               | gone     | free blocks (outcome done)               |
    | parked   | HandoffResume                | running  | unpark (outcome resumed)                 |
    | parked   | Abort                        | gone     | free blocks (outcome aborted)            |
    | parked   | refusal from the CPU worker  | parked   | HandoffRefused to the router (once)      |

    Reservation states (CPU worker): reserved → (header accepted) importing →
    (last part imported) running sequence; any refusal, Abort or expiry frees
    its blocks (a wrong token never touches it).
    """

    def __init__(self, engine, config: HandoffConfig, spec: KVSpec | None, pauses: PauseHooks | None = None):
        self.engine, self.config, self.spec = engine, config, spec
        self.pauses = pauses or PauseHooks()
        self.exporter = None  # GPU worker: a KVExporter, set by the worker process
        self.parked: dict[tuple[bytes, str], Parked] = {}
        self.reservations = Reservations(config.reservation_timeout_s)
        self.notices: list[tuple[bytes, object]] = []  # (router identity, message)
        self.replies: list[tuple[bytes, object]] = []  # (hand-off peer identity, message)
        self.outcomes: dict[str, int] = {}
        self.nbytes = 0
        self.export_s = self.copy_s = self.hidden_s = self.import_s = 0.0
        self._handlers = {
            HandoffReserve: self._on_reserve, HandoffRelease: self._on_release, HandoffResume: self._on_resume,
            HandoffIncoming: self._on_incoming,
        }

    def _count(self, outcome: HandoffOutcome) -> None:
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1

    def handles(self, msg) -> bool:
        return type(msg) in self._handlers or type(msg).__name__ == "ExportEvent"

    def handle(self, client: bytes, msg) -> None:
        handler = self._handlers.get(type(msg), self._on_export_event)
        handler(client, msg)

    def take_notices(self) -> tuple[list, list]:
        notices, replies = self.notices, self.replies
        self.notices, self.replies = [], []
        return notices, replies

    def fill_stats(self, s) -> None:
        s.handoff_bytes_total, s.handoff_export_seconds_total = self.nbytes, self.export_s
        s.handoff_copy_seconds_total, s.handoff_copy_hidden_seconds_total = self.copy_s, self.hidden_s
        s.handoff_import_seconds_total = self.import_s
        s.handoff_outcomes = dict(self.outcomes)
        s.handoff_parked, s.handoff_reservations = len(self.parked), len(self.reservations.by_id)
        s.handoff_recomputed = self.engine.scheduler.stats.recomputed_imports
        if self.exporter is not None:
            pool = self.exporter.pool.stats
            s.handoff_pool_bytes_in_use, s.handoff_pool_peak_bytes, s.handoff_pool_waits = (
                pool.bytes_in_use, pool.peak_bytes, pool.waits)

    # --- GPU worker: export and park ------------------------------------------

    def after_step(self, sampled) -> None:
        """Park and export every sequence that just got its first token and has a hand-off target."""
        for seq in sampled:
            target = seq.handoff
            if target is None:
                continue
            seq.handoff = None
            if seq.status.finished:
                self.notices.append((seq.client, HandoffExportFailed(seq.request_id, "finished")))
                continue
            if self.exporter is None:
                self.notices.append((seq.client, HandoffExportFailed(seq.request_id, "this worker cannot export KV")))
                continue
            self._export(seq, target)

    def _export(self, seq, target) -> None:
        spec, key = self.spec, (seq.client, seq.request_id)
        header = HandoffHeader(
            request_id=seq.request_id, token=target.token, fingerprint=spec.fingerprint,
            block_size=spec.block_size, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, layer_shapes=list(spec.layer_shapes), dtype=spec.dtype,
            num_tokens=seq.num_computed, rope_basis=ROPE_BASIS,
            prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids), params=seq.params, seed=seq.seed,
            max_tokens=seq.max_tokens, eos_token_id=seq.eos_token_id,
            next_token_index=seq.first_token_index + len(seq.output_ids))
        self.engine.scheduler.park(seq)
        job = ExportJob(key, target.endpoint, header, list(seq.block_table))
        self.parked[key] = Parked(seq, job)
        self.exporter.submit(job)

    def _on_export_event(self, _client: bytes, ev) -> None:
        if ev.kind == "refused":
            key = next((k for k in self.parked if k[1] == ev.key[1]), None)
            p = self.parked.get(key)
            if p is not None and not p.refused:
                p.refused = True
                self.notices.append((key[0], ev.refused))
            return
        p = self.parked.get(ev.key)
        if p is None:
            return
        p.copying = False
        seq = p.seq
        if ev.kind == "sent":
            self.nbytes += ev.nbytes
            self.export_s += ev.export_s
            self.copy_s += ev.copy_s
            self.hidden_s += ev.hidden_s
            if p.pending != "abort":
                self.notices.append((seq.client, HandoffExported(seq.request_id, ev.nbytes, ev.export_s * 1e3,
                                                                 ev.copy_s * 1e3)))
        elif ev.kind == "failed" and p.pending != "abort":
            self._count(HandoffOutcome.REFUSED)
            self.notices.append((seq.client, HandoffExportFailed(seq.request_id, ev.reason)))
            p.pending = "resume-quietly"
        elif ev.kind == "cancelled" and not p.pending:
            p.pending = "abort"
        if p.pending:
            self._settle(ev.key, p.pending)

    def _settle(self, key, action: str) -> None:
        """Apply release, resume or abort to a parked sequence whose blocks no copy reads."""
        p = self.parked.pop(key)
        seq = p.seq
        if action.startswith("resume"):
            if action == "resume":
                self._count(HandoffOutcome.RESUMED)
            self.engine.scheduler.unpark(seq)
            return
        self._count(HandoffOutcome.DONE if action == "release" else HandoffOutcome.ABORTED)
        self.engine._by_id.pop(key, None)
        seq.status = SequenceStatus.FINISHED_ABORTED
        self.engine.allocator.release(seq.block_table)

    def _on_release(self, client: bytes, msg: HandoffRelease) -> None:
        self._park_action((client, msg.request_id), "release")

    def _on_resume(self, client: bytes, msg: HandoffResume) -> None:
        self._park_action((client, msg.request_id), "resume")

    def _park_action(self, key, action: str) -> None:
        p = self.parked.get(key)
        if p is None:
            return  # already released, resumed or aborted: idempotent
        if p.copying:
            if p.pending != "abort":
                p.pending = action
            return
        self._settle(key, action)

    def abort_parked(self, key) -> bool:
        """Abort a parked sequence (its blocks freed once no copy reads them); False if not parked."""
        p = self.parked.get(key)
        if p is None:
            return False
        p.seq.status = SequenceStatus.FINISHED_ABORTED
        if p.copying:
            p.pending = "abort"
            p.job.cancelled.set()
        else:
            self._settle(key, "abort")
        return True

    # --- CPU worker: reserve and import ---------------------------------------

    def _on_reserve(self, client: bytes, msg: HandoffReserve) -> None:
        engine, rid = self.engine, msg.request_id

        def refuse(reason: str) -> None:
            self.notices.append((client, HandoffReservation(rid, False, reason=reason)))

        if engine.take_early_abort(client, rid):  # its abort overtook it on the fast path
            return refuse(f"request {rid!r} was aborted before its reservation arrived")
        if self.spec is None or not hasattr(engine.runner, "import_kv"):
            return refuse("this worker takes no KV hand-offs")
        if rid in self.reservations.by_id or (client, rid) in engine._by_id:
            return refuse(f"request {rid!r} is already here")
        if not 2 <= msg.num_tokens <= engine.runner.max_model_len:
            return refuse(f"num_tokens {msg.num_tokens} outside [2, max model length {engine.runner.max_model_len}]")
        table: list[int] = []
        if not engine.allocator.ensure(table, msg.num_tokens):
            need = engine.allocator.blocks_needed([], msg.num_tokens)
            return refuse(f"no free KV blocks: {need} needed, {engine.allocator.num_free} free")
        r = self.reservations.add(client, rid, msg.num_tokens, table)
        self.pauses.pause("reserved")
        self.notices.append((client, HandoffReservation(rid, True, token=r.token)))

    def abort_reservation(self, client: bytes, rid: str) -> bool:
        r = self.reservations.by_id.get(rid)
        if r is None or r.client != client:
            return False
        self._drop_reservation(r, HandoffOutcome.ABORTED)
        return True

    def _drop_reservation(self, r: Reservation, outcome: HandoffOutcome) -> None:
        self.reservations.by_id.pop(r.request_id, None)
        self.engine.allocator.release(r.block_table)
        self._count(outcome)

    def expire(self, now: float | None = None) -> None:
        for r in self.reservations.expired(time.monotonic() if now is None else now):
            self._drop_reservation(r, HandoffOutcome.EXPIRED)
            self.notices.append((r.client, HandoffRefused(r.request_id, "reservation", f"expired after "
                                                          f"{self.reservations.timeout_s} s")))

    def _on_incoming(self, peer: bytes, msg: HandoffIncoming) -> None:
        is_header = msg.kind == MsgType.HANDOFF_KV.value
        rid = ""
        try:
            first = decode_header(msg.body) if is_header else decode_part(msg.body)
            rid = first.request_id
            r = self.reservations.match(rid, first.token)
        except HandoffRefusal as exc:  # no live reservation: nobody to tell but the sender
            log.warning("hand-off refused: %s", exc)
            self._count(HandoffOutcome.DROPPED)
            self.replies.append((peer, HandoffRefused(rid, exc.field, exc.message)))
            return
        try:
            if is_header:
                self._accept_header(r, first)
            else:
                self._import_part(r, first, msg.frames)
        except HandoffRefusal as exc:
            log.warning("hand-off of %s refused: %s", r.request_id, exc)
            refusal = HandoffRefused(r.request_id, exc.field, exc.message)
            self.notices.append((r.client, refusal))
            self.replies.append((peer, refusal))
            self._drop_reservation(r, HandoffOutcome.REFUSED)

    def _accept_header(self, r: Reservation, header: HandoffHeader) -> None:
        if r.header is not None:
            raise HandoffRefusal("header", "a second header for the same reservation")
        check_header(header, self.spec, self.engine.runner.max_model_len, self.engine.runner.vocab_size)
        if not self.engine.allocator.ensure(r.block_table, header.num_tokens + 1):
            raise HandoffRefusal("num_tokens", f"{header.num_tokens} + 1 tokens need more blocks than the "
                                 f"{len(r.block_table)} reserved and {self.engine.allocator.num_free} free")
        r.header, r.started = header, time.monotonic()
        self.pauses.pause("importing")

    def _import_part(self, r: Reservation, part: HandoffPart, frames: list) -> None:
        h = r.header
        if h is None:
            raise HandoffRefusal("header", "KV frames came before the header")
        if part.first_layer != r.next_layer or part.num_layers < 1 or part.first_layer + part.num_layers > h.num_layers:
            raise HandoffRefusal("first_layer", f"part of layers {part.first_layer}..+{part.num_layers}, expected "
                                 f"layer {r.next_layer} of {h.num_layers}")
        if len(frames) != 2 * part.num_layers:
            raise HandoffRefusal("frames", f"{len(frames)} frames for {part.num_layers} layers, expected "
                                 f"{2 * part.num_layers} (K and V per layer)")
        start = time.monotonic()
        arrays = frames_to_float32(frames, h, self.spec, part.first_layer)
        for j in range(part.num_layers):  # a layer sharing another's K/V reads its source's: nothing to write
            layer = self.spec.model_layer(part.first_layer + j)
            self.engine.runner.import_kv(r.block_table, layer, arrays[2 * j], arrays[2 * j + 1])
        r.write_s += time.monotonic() - start
        r.next_layer += part.num_layers
        r.nbytes += sum(memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes for f in frames)
        if r.next_layer == h.num_layers:
            self._finish_import(r)

    def _finish_import(self, r: Reservation) -> None:
        from hybridgate.workers.sequence import Sequence

        h, engine = r.header, self.engine
        self.reservations.by_id.pop(r.request_id, None)
        seq = Sequence(imported_request(h), r.client)  # checked as an ADD with its header
        seq.output_ids = list(h.output_ids)
        if h.params.logprobs is not None:  # the GPU worker streamed these ids with their logprobs
            seq.output_logprobs = [None] * len(seq.output_ids)
        seq.sent = len(seq.output_ids)  # the GPU worker streamed them
        seq.num_computed = h.num_tokens
        seq.block_table = r.block_table
        seq.scheduled_once = True
        seq.imported, seq.cacheable = True, self.config.cache_imported_kv
        engine.scheduler.register_blocks(seq)
        engine._by_id[(r.client, seq.request_id)] = seq
        # A constrained one first rebuilds its matcher from the ids generated so far (its blocks held meanwhile).
        engine.admit(seq, lambda: engine.scheduler.unpark(seq))
        elapsed = time.monotonic() - r.started
        self.nbytes += r.nbytes
        self.import_s += elapsed
        self._count(HandoffOutcome.DONE)
        self.pauses.pause("imported")
        self.notices.append((r.client, HandoffImported(seq.request_id, h.next_token_index, elapsed * 1e3,
                                                                     r.write_s * 1e3)))
