"""The engine core: add and abort requests, schedule, run, sample (its loop is `engine_loop`).

Failure isolation: when a step raises, the engine finds the sequence to blame
by running parts of the batch again (halves, down to one sequence; after an
out-of-memory, first without the largest prefill), so a failure that belongs to
one request ends that request alone. A step that raised changed no sequence
(num_computed and output ids move only after it returns) and the KV it may
have written is rewritten identically by the rerun, so rerunning is safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from hybridgate.mempool import BlockAllocator
from hybridgate.wire import (
    ERROR_DEADLINE_EXCEEDED,
    ERROR_INTERNAL,
    ERROR_INVALID_CONSTRAINT,
    ERROR_INVALID_REQUEST,
    ERROR_NO_KV_BLOCKS,
    ERROR_QUEUE_FULL,
    ERROR_RESOURCE_EXHAUSTED,
    AddRequest,
    EngineStats,
    InvalidFieldError,
    RequestError,
    SamplingParams,
    SeqOutput,
)
from hybridgate.workers.constraints import (
    DEFAULT_GRAMMAR_CACHE_SIZE,
    DEFAULT_GRAMMAR_COMPILE_THREADS,
    Constraints,
    GrammarCompiler,
    ll_tokenizer_of_metadata,
)
from hybridgate.workers.faults import InjectedFault
from hybridgate.workers.guard import Refusals, WireErrors, check_add
from hybridgate.workers import pooling
from hybridgate.workers.handoff import EngineHandoffs, HandoffConfig, KVSpec
from hybridgate.workers.rates import StepCost, StepRates
from hybridgate.workers.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SchedulerStats
from hybridgate.workers.sequence import FINISH_OF_STATUS, Sequence, SequenceStatus

log = logging.getLogger(__name__)

_MAX_EARLY_ABORTS = 4096


class ModelRunner(Protocol):
    """Turns a scheduled batch into sampled ids; knows batches and blocks, not requests."""

    kind: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    block_bytes: int  # one block across all layers, K and V

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Run the batch (it does not change the sequences); return the id sampled
        for each sequence whose every token is computed after this step. A runner that
        computes logprobs (for sequences whose params ask) also has `take_logprobs()`,
        which returns those of its last `execute` and forgets them."""

    def pool_stats(self):
        """The PinnedPool's stats (bytes in use, peak, fallbacks)."""

    def kernel_cache_stats(self) -> tuple[int, int]:
        """(kernels loaded from the on-disk cache, kernels compiled); (0, 0) where nothing is compiled."""


class EngineCore:
    """Sequences, scheduler, block allocator and runner; one `step()` is one forward pass."""

    def __init__(self, runner: ModelRunner, scheduler_config: SchedulerConfig, fingerprint: str = "",
                 prefix_caching: bool = True, wire_errors: WireErrors | None = None,
                 handoff: HandoffConfig | None = None, constraints: Constraints | None = None):
        self.runner = runner
        self.wire_errors = wire_errors or WireErrors()  # shared with the worker's I/O thread
        self.refusals = Refusals()  # messages refused at a queue's bound (the worker shares its Inbox's)
        self.allocator = BlockAllocator(runner.num_blocks, runner.block_size, prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.allocator, fingerprint)
        self.stats = EngineStats(blocks_total=runner.num_blocks)
        self.rates = StepRates()  # measured speeds for the load report (hybridgate/workers/rates.py)
        self.scheduler.cost = StepCost(self.rates.decode.medians, self.rates.prefill.medians)  # live views
        # Sequences whose prompt chunk ran in the last step without sampling a token yet: the loop
        # reports them as progress (an empty output), so a router can tell a long prefill from a stall.
        self.last_prefilled: list[Sequence] = []
        self._by_id: dict[tuple[bytes, str], Sequence] = {}
        # Aborts that overtook their request (the request queue and the abort fast path race):
        # the request is dropped when it arrives. Bounded, oldest forgotten first.
        self._early_aborts: dict[tuple[bytes, str], None] = {}
        # Start-up figures: the kernels were compiled or loaded by the runner's warm-up.
        self.stats.kernel_cache_hits, self.stats.kernel_cache_misses = runner.kernel_cache_stats()
        self._failures: list[tuple[Sequence, RequestError]] = []
        self._logprobs: dict = {}  # Sequence → TokenLogprobs of the step being run
        self._take_logprobs = getattr(runner, "take_logprobs", None)
        self._pooled: dict = {}  # Sequence → partial sum of its pooled hidden states in the step being run
        self._take_pooled = getattr(runner, "take_pooled", None)
        layout = getattr(runner, "kv_layout", None)
        spec = KVSpec.of(fingerprint, runner.block_size, layout()) if layout is not None else None
        self.handoffs = EngineHandoffs(self, handoff or HandoffConfig(), spec)
        self.constraints = constraints or default_constraints(runner)

    def add(self, request: AddRequest, client: bytes = b"") -> RequestError | None:
        """Queue a request; the error to answer when it is refused, else None.

        Refused: an ADD that fails `check_add` (code invalid_request, counted as
        a wire error; answered only when it has a request id), and one that needs
        more KV blocks than the cache holds (code no_kv_blocks: another worker
        may hold it), and one past a waiting queue of --max-num-waiting (code
        queue_full: another worker may have room). Dropped without an answer: a duplicate of a live (client,
        request_id), counted (an error would end the live request at the
        router), and a request whose abort overtook it.
        """
        rid = request.request_id
        if self.take_early_abort(client, rid):
            return None  # aborted before it arrived
        try:
            check_add(request, self.runner.vocab_size, self.runner.max_model_len)
        except InvalidFieldError as exc:
            self.wire_errors.record("invalid ADD", f"request {rid[:64]!r} from {client[:32]!r}: {exc}")
            if not rid:
                return None  # no request to answer for
            return RequestError(rid, f"the worker refused the request: {exc}", ERROR_INVALID_REQUEST)
        if (client, rid) in self._by_id:
            self.wire_errors.record("duplicate ADD", f"request {rid[:64]!r} from {client[:32]!r} is already running")
            return None
        total = len(request.prompt_ids) + request.max_tokens
        if self.allocator.blocks_needed([], total) > self.allocator.num_blocks:
            return RequestError(rid, f"prompt + max_tokens = {total} tokens needs more KV blocks than "
                                f"the cache holds ({self.allocator.num_blocks} of {self.allocator.block_size} tokens); "
                                "raise --kv-cache-memory", ERROR_NO_KV_BLOCKS)
        limit = self.scheduler.config.max_num_waiting
        if len(self.scheduler.waiting) >= limit:
            return RequestError(rid, f"the worker's waiting queue is full ({limit} requests, --max-num-waiting)",
                                ERROR_QUEUE_FULL)
        seq = Sequence(request, client)
        self._by_id[(client, seq.request_id)] = seq
        self.admit(seq, lambda: self.scheduler.add(seq))
        return None

    def admit(self, seq: Sequence, schedule: Callable[[], None]) -> None:
        """Schedule a new (or imported) sequence: at once, or once its constraint's grammar is compiled."""
        if seq.params.constraint is None:
            schedule()
        else:
            self.constraints.wait_for_grammar(seq, schedule)

    def _admit_compiled(self) -> None:
        """Schedule the sequences whose grammar is ready; fail those whose grammar failed."""
        for seq, reason in self.constraints.poll():
            self._by_id.pop((seq.client, seq.request_id), None)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)  # frees an imported sequence's blocks
            self._failures.append((seq, RequestError(seq.request_id, f"constraint: {reason}",
                                                     ERROR_INVALID_CONSTRAINT)))

    def abort(self, request_ids: list[str], client: bytes = b"") -> list[Sequence]:
        """Finish these sequences now and free their blocks; unknown ids are ignored (idempotent)."""
        aborted = []
        for rid in request_ids:
            seq = self._by_id.pop((client, rid), None)
            if seq is not None:
                self.constraints.discard(seq)
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

    def take_early_abort(self, client: bytes, request_id: str) -> bool:
        """Whether an abort for this request arrived before the request did (and forget it)."""
        return self._early_aborts.pop((client, request_id), False) is None

    def abort_client(self, client: bytes) -> list[str]:
        """Abort every sequence of this router; their request ids."""
        ids = [rid for c, rid in list(self._by_id) if c == client]
        self.abort(ids, client)
        return ids

    def has_work(self) -> bool:
        """Sequences to run, or waiting for their grammar (`step` schedules them once it is compiled)."""
        return self.scheduler.has_work() or bool(self.constraints.waiting_for_grammar)

    def _observe_context(self, decodes: int, prompts: list[tuple[Sequence, int]], seconds: float) -> None:
        """Feed a step that ran `decodes` decodes and the prompt chunks `prompts` (sequence, tokens; their
        positions before the step) in `seconds` to the cost model's context term (`rates.ContextCost`)."""
        cost, tokens = self.scheduler.cost, sum(n for _, n in prompts)
        if cost is None or not decodes or not tokens:
            return
        decode_s, token_s = cost.decode_s(decodes), cost.token_s(decodes + tokens)
        if decode_s is None or token_s is None:
            return
        positions = sum(n * seq.num_computed + n * (n - 1) / 2 for seq, n in prompts)
        cost.context.observe(seconds, decode_s, tokens, token_s, positions / tokens)

    def step(self) -> list[Sequence]:
        """One forward pass; returns the sequences that got a token (finished ones included).

        Sequences blamed for a failure of the step are finished (aborted) and
        their errors wait in `take_failures()`; the rest of the batch goes on.
        """
        for seq in self.scheduler.expire(time.monotonic()):  # expired before any work: never run
            self._by_id.pop((seq.client, seq.request_id), None)
            self._failures.append((seq, RequestError(
                seq.request_id, f"its deadline ({seq.deadline - seq.arrival:.3f} s after arrival) passed while it "
                "waited on the worker; it was not run", ERROR_DEADLINE_EXCEEDED)))
        self._admit_compiled()
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        # Constrained (or below min_tokens) sequences that sample this step: their bitmasks fill while the
        # forward pass runs.
        batch.masks = self.constraints.start_masks(
            [s for s, n in batch.entries if s.num_computed + n == s.num_tokens], self.runner.vocab_size)
        now = time.monotonic()
        for seq, _ in batch.entries:
            if not seq.output_ids and seq.queue_ms == 0.0:
                seq.queue_ms = (now - seq.arrival) * 1e3
        started = time.perf_counter()
        sampled, failed = self._execute_isolating(batch.entries, batch.masks)
        if not failed:  # a step that reran parts of itself is no measure of speed
            seconds = time.perf_counter() - started
            prompts = [(seq, n) for seq, n in batch.entries if not (n == 1 and seq.output_ids)]
            self._observe_context(len(batch) - len(prompts), prompts, seconds)
            self.rates.record_step(batch.num_tokens, len(batch), bool(prompts), seconds)
        if failed:
            batch = ScheduledBatch([(s, n) for s, n in batch.entries if s not in failed])
            for seq, exc in failed.items():
                self._fail_one(seq, exc)
        pooled, self._pooled = self._pooled, {}
        self.last_prefilled = [seq for seq, _ in batch.entries if seq not in sampled and not seq.pooling]
        for seq, n in batch.entries:
            if seq in pooled:
                pooling.accumulate(seq, pooled[seq])
            seq.num_computed += n
        self.scheduler.after_step(batch)
        logprobs, self._logprobs = self._logprobs, {}
        if batch.masks is not None:
            batch.masks.join()  # a step that failed before sampling must not leave a fill reading its matchers
            self.constraints.mask_wait_seconds += batch.masks.wait_s
        for seq, token in sampled.items():
            seq.append(token, logprobs.get(seq))
            if seq.matcher is not None:
                self._advance_matcher(seq, token)
            if seq.status.finished:
                self._by_id.pop((seq.client, seq.request_id), None)
                self.scheduler.finish(seq, seq.status)
        self.handoffs.after_step(sampled)  # gpu->cpu: park and export after the first token
        self.stats.steps += 1
        self.stats.batch_size_counts[len(batch)] = self.stats.batch_size_counts.get(len(batch), 0) + 1
        return list(sampled) + self._finish_embeddings(batch)

    def _finish_embeddings(self, batch: ScheduledBatch) -> list[Sequence]:
        """The embedding sequences whose whole prompt is computed now: finished (stop) with their vector."""
        done = [s for s, _ in batch.entries if s.pooling and s.num_computed == s.num_tokens]
        for seq in done:
            seq.embedding = pooling.embedding_bytes(seq)
            self._by_id.pop((seq.client, seq.request_id), None)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        return done

    def _advance_matcher(self, seq: Sequence, token: int) -> None:
        """Feed the sampled id to the sequence's matcher; a grammar that admits nothing more ends it (stop)."""
        error = self.constraints.advance(seq, token)
        if error is not None:
            log.error("request %r: %s", seq.request_id, error)
            self._failures.append((seq, RequestError(seq.request_id, error, ERROR_INTERNAL)))
            seq.status = SequenceStatus.FINISHED_ABORTED
        elif not seq.status.finished and seq.matcher.is_stopped():
            seq.status = SequenceStatus.FINISHED_STOPPED

    def _execute_isolating(self, entries: list, masks=None) -> tuple[dict[Sequence, int], dict[Sequence, BaseException]]:
        """Run the entries; on a failure, rerun parts of them to find the sequences to blame.

        Returns the sampled ids of the entries that ran and the exception of each
        blamed sequence. An out-of-memory in a step with a prefill first reruns
        the step without its largest prefill, then that prefill alone (so memory,
        not the request, is blamed only when the prefill fails by itself); any
        other failure splits the entries in halves, down to single sequences. A
        failure that does not come back on the rerun blames no one.
        """
        try:
            sampled = self.runner.execute(ScheduledBatch(entries, masks))
            if self._take_logprobs is not None:
                self._logprobs.update(self._take_logprobs())
            if self._take_pooled is not None:
                self._pooled.update(self._take_pooled())
            return sampled, {}
        except Exception as exc:
            if len(entries) == 1:
                return {}, {entries[0][0]: exc}
            log.warning("a step of %d sequences failed (%s: %s); rerunning parts of it to find the cause",
                        len(entries), type(exc).__name__, exc)
            prefills = [e for e in entries if e[1] > 1]
            if _is_out_of_memory(exc) and prefills:
                largest = max(prefills, key=lambda e: e[1])
                parts = [[e for e in entries if e is not largest], [largest]]
            else:
                parts = [entries[: len(entries) // 2], entries[len(entries) // 2 :]]
        sampled, failed = {}, {}
        for part in parts:
            s, f = self._execute_isolating(part, masks)
            sampled.update(s)
            failed.update(f)
        return sampled, failed

    def _fail_one(self, seq: Sequence, exc: BaseException) -> None:
        oom = _is_out_of_memory(exc)
        log.error("request %r failed in a step (%s: %s); the rest of its batch goes on", seq.request_id,
                  type(exc).__name__, exc, exc_info=not oom and not isinstance(exc, _QUIET_FAILURES))
        code = ERROR_RESOURCE_EXHAUSTED if oom else ERROR_INTERNAL
        what = "ran out of memory" if oom else "failed"
        self._failures.append((seq, RequestError(seq.request_id, f"the worker {what} running this request: "
                                                 f"{type(exc).__name__}: {exc}", code)))
        self.fail([seq])

    def take_failures(self) -> list[tuple[Sequence, RequestError]]:
        """Sequences failed by steps since the last call, each with the error to answer."""
        failures, self._failures = self._failures, []
        return failures

    def fail(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._by_id.pop((seq.client, seq.request_id), None)
            self.constraints.discard(seq)
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def refresh_stats(self) -> EngineStats:
        s, sched, pool = self.stats, self.scheduler, self.runner.pool_stats()
        s.blocks_used = self.allocator.num_used
        s.kv_cache_bytes = s.blocks_used * self.runner.block_bytes
        # waiting: those whose grammar compiles too (they are queued as far as placement is concerned)
        s.running, s.waiting = len(sched.running), len(sched.waiting) + len(self.constraints.waiting_for_grammar)
        s.preemptions, s.prefill_tokens, s.cached_tokens = (
            sched.stats.preemptions, sched.stats.prefill_tokens, sched.stats.cached_tokens)
        s.pinned_bytes_in_use, s.pinned_peak_bytes, s.pinned_fallbacks = (
            pool.bytes_in_use, pool.peak_bytes, pool.fallbacks)
        s.wire_decode_errors = self.wire_errors.total
        s.queue_refusals = self.refusals.counts()
        self.handoffs.fill_stats(s)
        s.queued_prefill_tokens = sum(q.num_tokens - q.num_computed for q in sched.waiting) + sum(
            q.num_tokens - q.num_computed for q in sched.running if q.num_tokens - q.num_computed > 1)
        s.decoding = sum(1 for q in sched.running if q.num_tokens - q.num_computed == 1)
        s.blocks_cached = self.allocator.stats().cached
        s.blocks_committed = s.blocks_used + sum(self._blocks_to_finish(q) for q in (*sched.waiting, *sched.running))
        s.max_num_seqs, s.max_num_batched_tokens = sched.config.max_num_seqs, sched.config.max_num_batched_tokens
        s.prefill_tokens_per_s, s.decode_step_s = self.rates.prefill.medians, self.rates.decode.medians
        self._constraint_stats(s)
        return s

    def _constraint_stats(self, s: EngineStats) -> None:
        c, sched = self.constraints, self.scheduler
        s.constrained_requests, s.waiting_for_grammar = c.requests, len(c.waiting_for_grammar)
        s.constrained_running = sum(q.matcher is not None for q in (*sched.waiting, *sched.running))
        s.mask_fills, s.mask_fill_seconds_total, s.mask_wait_seconds_total = (
            c.mask_fills, c.mask_fill_seconds, c.mask_wait_seconds)
        if c.compiler is not None:
            k = c.compiler.stats
            s.grammar_compiles, s.grammar_compile_errors, s.grammar_compile_seconds_total, s.grammar_cache_hits = (
                k.compiles, k.compile_errors, k.compile_seconds, k.cache_hits)

    def _blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks `seq` still needs to reach its end: max_tokens, or a hand-off's first token."""
        final = min(len(seq.prompt_ids) + (1 if seq.handoff else seq.max_tokens), self.runner.max_model_len)
        return self.allocator.blocks_needed(seq.block_table, final)

    def measure_rates(self, prefill_lens: tuple[int, ...] = (32, 256),
                      decode_batches: tuple[int, ...] = (1, 8), decode_steps: int = 2) -> None:
        """Seed the rate tables before READY: one prefill step per length, `decode_steps` decode steps per
        batch size, on synthetic prompts that stay out of the prefix cache; counters are reset after.

        Lengths and batches are capped by the scheduler's budget, the model length and the KV cache.
        """
        budget, limit = self.scheduler.config.max_num_batched_tokens, self.runner.max_model_len
        ids = lambda n, k: [(7 * i + 13 * k) % (self.runner.vocab_size - 3) + 3 for i in range(n)]  # noqa: E731
        greedy = SamplingParams(temperature=0)
        jobs = [[(ids(min(n, budget, limit - 2), k), 1)] for k, n in enumerate(prefill_lens)]
        jobs += [[(ids(8, 100 + b * 64 + j), decode_steps + 1) for j in range(min(b, self.scheduler.config.max_num_seqs))]
                 for b in decode_batches]
        for k, job in enumerate(jobs):
            need = sum(self.allocator.blocks_needed([], len(p) + m) for p, m in job)
            if need > self.allocator.num_blocks:
                continue
            for j, (prompt, max_tokens) in enumerate(job):
                rid = f"rates-{k}-{j}"
                self.add(AddRequest(rid, prompt, greedy, 0, max_tokens, -1), b"\x00rates")
                self._by_id[(b"\x00rates", rid)].cacheable = False
            while self.has_work():
                self.step()
        kernel_hits, kernel_misses = self.stats.kernel_cache_hits, self.stats.kernel_cache_misses
        self.stats = EngineStats(blocks_total=self.runner.num_blocks, kernel_cache_hits=kernel_hits,
                                 kernel_cache_misses=kernel_misses)
        self.scheduler.stats = SchedulerStats()
        self.take_failures()


def default_constraints(runner: ModelRunner, cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
                        compile_threads: int = DEFAULT_GRAMMAR_COMPILE_THREADS) -> Constraints:
    """Constraints over the runner's tokenizer (its GGUF `metadata`); a runner without one refuses them."""
    metadata = getattr(runner, "metadata", None)
    if metadata is None:
        return Constraints(None)
    return Constraints(GrammarCompiler(lambda: ll_tokenizer_of_metadata(metadata), cache_size, compile_threads))


def _is_out_of_memory(exc: BaseException) -> bool:
    """Host MemoryError or torch's (CUDA) OutOfMemoryError, without importing torch here."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


# Failures whose traceback says nothing more than their message (the test hook's).
_QUIET_FAILURES: tuple[type[BaseException], ...] = (InjectedFault,)


def output_of(seq: Sequence) -> SeqOutput:
    """The ids not yet sent, with the finish reason once finished."""
    first = seq.sent == 0
    out = SeqOutput(
        request_id=seq.request_id,
        token_index=seq.first_token_index + seq.sent,
        token_ids=seq.output_ids[seq.sent :],
        finish=int(FINISH_OF_STATUS[seq.status]) if seq.status.finished else 0,
        queue_ms=seq.queue_ms if first else 0.0,
        cached_tokens=seq.cached_tokens if first else 0,
        logprobs=seq.output_logprobs[seq.sent :] if seq.params.logprobs is not None else [],
        embedding=seq.embedding,
    )
    seq.sent = len(seq.output_ids)
    return out
