"""The engine core and its loop: drain inputs, schedule, run, sample, push outputs.

The loop is plain synchronous code in the worker's main thread (or a thread
of the in-process client); socket I/O happens elsewhere and reaches it through
`Inbox`. vLLM's v1 engine core has the same shape.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

from hybridgate.mempool import BlockAllocator
from hybridgate.wire import Abort, AddRequest, EngineStats, Outputs, RequestError, SeqOutput
from hybridgate.workers.handoff import HandoffConfig, HandoffState, KVSpec
from hybridgate.workers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from hybridgate.workers.sequence import FINISH_OF_STATUS, Sequence, SequenceStatus

log = logging.getLogger(__name__)

_MAX_EARLY_ABORTS = 4096


class ModelRunner(Protocol):
    """Turns a scheduled batch into sampled ids; knows batches and blocks, not requests."""

    kind: str
    max_model_len: int
    num_blocks: int
    block_size: int
    block_bytes: int  # one block across all layers, K and V

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Run the batch (it does not change the sequences); return the id sampled
        for each sequence whose every token is computed after this step."""

    def pool_stats(self):
        """The PinnedPool's stats (bytes in use, peak, fallbacks)."""

    def kernel_cache_stats(self) -> tuple[int, int]:
        """(kernels loaded from the on-disk cache, kernels compiled); (0, 0) where nothing is compiled."""


class EngineCore:
    """Sequences, scheduler, block allocator and runner; one `step()` is one forward pass."""

    def __init__(self, runner: ModelRunner, scheduler_config: SchedulerConfig, fingerprint: str = "",
                 prefix_caching: bool = True, handoff: HandoffConfig | None = None):
        self.runner = runner
        self.allocator = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.allocator, fingerprint)
        self.stats = EngineStats(blocks_total=runner.num_blocks)
        self._by_id: dict[tuple[bytes, str], Sequence] = {}
        # Aborts that overtook their request (the request queue and the abort fast path race):
        # the request is dropped when it arrives. Bounded, oldest forgotten first.
        self._early_aborts: dict[tuple[bytes, str], None] = {}
        # Start-up figures: the kernels were compiled or loaded by the runner's warm-up.
        self.stats.kernel_cache_hits, self.stats.kernel_cache_misses = runner.kernel_cache_stats()
        layout = getattr(runner, "kv_layout", None)
        spec = KVSpec(fingerprint, runner.block_size, *layout()) if layout is not None else None
        self.handoffs = HandoffState(self, handoff or HandoffConfig(), spec)

    def add(self, request: AddRequest, client: bytes = b"") -> RequestError | None:
        if (client, request.request_id) in self._early_aborts:
            del self._early_aborts[(client, request.request_id)]
            return None  # aborted before it arrived
        total = len(request.prompt_ids) + request.max_tokens
        if not request.prompt_ids or total > self.runner.max_model_len:
            return RequestError(request.request_id, f"prompt + max_tokens = {total} tokens exceeds max model "
                                f"length {self.runner.max_model_len} (or the prompt is empty)")
        if self.allocator.blocks_needed([], total) > self.allocator.num_blocks:
            return RequestError(request.request_id, f"prompt + max_tokens = {total} tokens needs more KV blocks than "
                                f"the cache holds ({self.allocator.num_blocks} of {self.allocator.block_size} tokens); "
                                "raise --kv-cache-memory")
        seq = Sequence(request, client)
        self._by_id[(client, seq.request_id)] = seq
        self.scheduler.add(seq)
        return None

    def abort(self, request_ids: list[str], client: bytes = b"") -> list[Sequence]:
        """Finish these sequences now and free their blocks; unknown ids are ignored (idempotent)."""
        aborted = []
        for rid in request_ids:
            seq = self._by_id.pop((client, rid), None)
            if seq is not None:
                # A parked sequence (hand-off export) frees its blocks once no copy reads them.
                if not self.handoffs.abort_parked((client, rid)):
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                aborted.append(seq)
            elif self.handoffs.abort_reservation(client, rid):
                pass
            else:
                self._early_aborts[(client, rid)] = None
                if len(self._early_aborts) > _MAX_EARLY_ABORTS:
                    del self._early_aborts[next(iter(self._early_aborts))]
        return aborted

    def abort_client(self, client: bytes) -> None:
        self.abort([rid for c, rid in list(self._by_id) if c == client], client)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """One forward pass; returns the sequences that got a token (finished ones included)."""
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        now = time.monotonic()
        for seq, _ in batch.entries:
            if not seq.output_ids and seq.queue_ms == 0.0:
                seq.queue_ms = (now - seq.arrival) * 1e3
        sampled = self.runner.execute(batch)
        for seq, n in batch.entries:
            seq.num_computed += n
        self.scheduler.after_step(batch)
        for seq, token in sampled.items():
            seq.append(token)
            if seq.status.finished:
                self._by_id.pop((seq.client, seq.request_id), None)
                self.scheduler.finish(seq, seq.status)
        self.handoffs.after_step(sampled)  # gpu->cpu: park and export after the first token
        self.stats.steps += 1
        self.stats.batch_size_counts[len(batch)] = self.stats.batch_size_counts.get(len(batch), 0) + 1
        return list(sampled)

    def fail(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._by_id.pop((seq.client, seq.request_id), None)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def refresh_stats(self) -> EngineStats:
        s, sched, pool = self.stats, self.scheduler, self.runner.pool_stats()
        s.blocks_used = self.allocator.num_used
        s.kv_cache_bytes = s.blocks_used * self.runner.block_bytes
        s.running, s.waiting = len(sched.running), len(sched.waiting)
        s.preemptions, s.prefill_tokens, s.cached_tokens = (
            sched.stats.preemptions, sched.stats.prefill_tokens, sched.stats.cached_tokens)
        s.pinned_bytes_in_use, s.pinned_peak_bytes, s.pinned_fallbacks = (
            pool.bytes_in_use, pool.peak_bytes, pool.fallbacks)
        self.handoffs.fill_stats(s)
        return s


def output_of(seq: Sequence) -> SeqOutput:
    """The ids not yet sent, with the finish reason once finished."""
    first = seq.sent == 0
    out = SeqOutput(
        request_id=seq.request_id,
        token_index=seq.sent,
        token_ids=seq.output_ids[seq.sent :],
        finish=int(FINISH_OF_STATUS[seq.status]) if seq.status.finished else 0,
        queue_ms=seq.queue_ms if first else 0.0,
        cached_tokens=seq.cached_tokens if first else 0,
    )
    seq.sent = len(seq.output_ids)
    return out


class Inbox:
    """What the I/O side hands the engine: new requests on a queue, aborts on a fast path."""

    def __init__(self) -> None:
        self.requests: queue.Queue = queue.Queue()
        self._aborts: list[tuple[bytes, list[str]]] = []
        self._lock = threading.Lock()

    def put_abort(self, client: bytes, msg: Abort) -> None:
        with self._lock:
            self._aborts.append((client, msg.request_ids))
        self.requests.put(None)  # wake an idle engine

    def take_aborts(self) -> list[tuple[bytes, list[str]]]:
        with self._lock:
            aborts, self._aborts = self._aborts, []
        return aborts


class EngineLoop:
    """The busy loop. `send(client, message)` delivers outputs and errors."""

    def __init__(self, engine: EngineCore, inbox: Inbox, send: Callable[[bytes, object], None],
                 send_handoff: Callable[[bytes, object], None] | None = None):
        self.engine = engine
        self.inbox = inbox
        self.send = send
        self.send_handoff = send_handoff  # replies on the hand-off socket (CPU worker)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self._drain(block=not self.engine.has_work())
            self._apply_aborts(set())
            self.engine.handoffs.expire()
            self._flush_handoff_notices()
            if not self.engine.has_work():
                self.engine.refresh_stats()
                continue
            try:
                stepped = self.engine.step()
            except Exception as exc:  # a failed step fails its sequences, never the worker
                log.exception("engine step failed")
                self._fail_batch(exc)
                continue
            self._apply_aborts({id(s) for s in stepped})
            self._push([s for s in stepped if s.status != SequenceStatus.FINISHED_ABORTED])
            self._flush_handoff_notices()

    def _flush_handoff_notices(self) -> None:
        notices, replies = self.engine.handoffs.take_notices()
        for client, msg in notices:
            self.send(client, msg)
        for peer, msg in replies:
            if self.send_handoff is not None:
                self.send_handoff(peer, msg)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.requests.get(timeout=0.05) if block else self.inbox.requests.get_nowait()
            while True:
                if item is not None:
                    self._handle(*item)
                item = self.inbox.requests.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, client: bytes, msg: object) -> None:
        if isinstance(msg, AddRequest):
            error = self.engine.add(msg, client)
            if error is not None:
                self.send(client, error)
        elif msg == "client-gone":
            self.engine.abort_client(client)
        elif self.engine.handoffs.handles(msg):
            self.engine.handoffs.handle(client, msg)

    def _apply_aborts(self, stepped: set[int]) -> None:
        for client, ids in self.inbox.take_aborts():
            for seq in self.engine.abort(ids, client):
                if id(seq) in stepped:  # sampled in the step during which its abort arrived
                    self.engine.stats.tokens_after_abort += len(seq.output_ids) - seq.sent

    def _push(self, stepped: list[Sequence]) -> None:
        by_client: dict[bytes, list[SeqOutput]] = defaultdict(list)
        for seq in stepped:
            by_client[seq.client].append(output_of(seq))
        stats = self.engine.refresh_stats()
        for client, outputs in by_client.items():
            self.send(client, Outputs(outputs, stats))

    def _fail_batch(self, exc: Exception) -> None:
        seqs = list(self.engine.scheduler.running)
        self.engine.fail(seqs)
        for seq in seqs:
            self.send(seq.client, RequestError(seq.request_id, f"worker step failed: {exc}"))
