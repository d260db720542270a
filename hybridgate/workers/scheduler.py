"""Continuous batching over a paged KV cache: which tokens run in the next step.

A pure state machine (no sockets, no devices; tests feed it fake model
outputs). New prompts join between steps and finished sequences leave (Orca,
Yu et al., OSDI 2022). Each step spends a token budget: first one token for
every running decode, then chunks of prefills in progress, then new prompts
(chunked prefill, as in Sarathi, Agrawal et al. 2023). A step that carries decodes
runs only as many prompt tokens as keep it within --mixed-step-budget times the
decode step, by the worker's measured rates and the prompt's context (`rates.StepCost`), and at least
--min-prefill-chunk, so a long prompt neither stalls the running streams nor
starves (Sarathi-Serve's stall-free batching). When KV blocks run out,
the most recently admitted sequence gives its blocks back and is recomputed
later (preemption by recomputation, as vLLM does); sequences imported by a KV
hand-off go last. Prompts look up their longest cached prefix first (prefix
caching); blocks of sequences marked not cacheable (imported KV) never enter it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridgate.workers.config import SchedulerConfig
from hybridgate.mempool import BlockAllocator, block_hash, prefix_block_hashes
from hybridgate.workers.rates import StepCost
from hybridgate.workers.sequence import Sequence, SequenceStatus
from hybridgate.wire import PoolingType


@dataclass
class ScheduledBatch:
    """One step: (sequence, number of new tokens to run) in execution order."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    # The token bitmasks of its constrained sequences (`constraints.StepMasks`), filled while it runs.
    masks: object | None = None

    @property
    def sequences(self) -> list[Sequence]:
        return [s for s, _ in self.entries]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens actually run
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    recomputed_imports: int = 0  # preempted sequences whose KV came from a hand-off


def _is_decode(seq: Sequence, n: int) -> bool:
    return n == 1 and bool(seq.output_ids) and seq.num_computed == seq.num_tokens - 1


class Scheduler:
    """Waiting and running queues over a `BlockAllocator`."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, fingerprint: str = ""):
        self.config, self.allocator, self.fingerprint = config, allocator, fingerprint
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.cost: StepCost | None = None  # the engine's measured rates; None: chunks of the token budget only

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def expire(self, now: float) -> list[Sequence]:
        """Drop the waiting sequences that never ran and whose deadline is before `now` (monotonic
        seconds); they are finished as aborted, with their blocks freed, and returned."""
        expired = [s for s in self.waiting if s.deadline is not None and s.deadline < now
                   and not s.output_ids and not s.scheduled_once]
        for seq in expired:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return expired

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.config.max_num_batched_tokens
        preempted = False
        for seq in [s for s in self.running if s.num_tokens - s.num_computed == 1]:  # decodes
            if budget == 0 or seq.status != SequenceStatus.RUNNING:
                continue
            if not self._reserve(seq, 1, batch):
                preempted = True
                continue
            batch.entries.append((seq, 1))
            budget -= 1
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed > 1]  # prefills in progress
        first = prefilling[0] if prefilling else self.waiting[0] if self.waiting else None
        budget = self._prefill_budget(len(batch), budget, first.num_computed if first is not None else 0)
        for seq in prefilling:
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n and self.allocator.ensure(seq.block_table, seq.num_computed + n):
                batch.entries.append((seq, n))
                budget -= n
        while self.waiting and budget and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self._lookup_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.allocator.ensure(seq.block_table, seq.num_computed + n):
                self._reset(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.entries.append((seq, n))
            budget -= n
        self.stats.prefill_tokens += sum(n for s, n in batch.entries if not _is_decode(s, n))
        return batch

    def _prefill_budget(self, decodes: int, budget: int, context: int) -> int:
        """The prompt tokens a step with `decodes` decodes may run: `budget` (what the step's token budget
        leaves), less when the step carries decodes and the cost model predicts it would pass
        --mixed-step-budget x the decode step, the next prompt chunk starting at context position
        `context`; never below --min-prefill-chunk unless `budget` is."""
        factor = self.config.mixed_step_budget
        if not decodes or not factor or self.cost is None:
            return budget
        limit = self.cost.prefill_budget(decodes, factor, self.config.min_prefill_chunk, context)
        return budget if limit is None else min(budget, limit)

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for n more tokens of a running sequence, preempting the newest until they fit."""
        while not self.allocator.ensure(seq.block_table, seq.num_computed + n):
            # The newest first, imported sequences last (their KV crossed machines to get here);
            # never one already in this step's batch (the newest of all never is: it comes last).
            batched = {id(s) for s, _ in batch.entries}
            victim = next((s for s in reversed(self.running) if not s.imported and id(s) not in batched),
                          self.running[-1])
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give the sequence's blocks back; it is recomputed (prompt and output) when readmitted."""
        self.running.remove(seq)
        self._reset(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        if seq.imported:
            self.stats.recomputed_imports += 1

    def _reset(self, seq: Sequence) -> None:
        self.allocator.release(seq.block_table)
        seq.num_computed = 0

    def _lookup_prefix(self, seq: Sequence) -> None:
        if seq.block_table or seq.num_computed:
            return
        ids = seq.all_ids
        usable = (len(ids) - 1) // self.allocator.block_size  # the last token is always computed
        if seq.pooling in (PoolingType.MEAN, PoolingType.CLS):  # embeddings pooled over the prompt from position 0
            usable = 0
        hashes = prefix_block_hashes(ids, self.fingerprint, self.allocator.block_size, usable)
        seq.block_table = self.allocator.lookup(hashes)
        seq.block_hashes = hashes[: len(seq.block_table)]
        seq.num_computed = len(seq.block_table) * self.allocator.block_size
        if not seq.scheduled_once:
            seq.cached_tokens = seq.num_computed
            self.stats.cached_tokens += seq.num_computed
        seq.scheduled_once = True

    def after_step(self, batch: ScheduledBatch) -> None:
        """Register every block a step filled, so later prompts can reuse it."""
        for seq, _ in batch.entries:
            self.register_blocks(seq)

    def register_blocks(self, seq: Sequence) -> None:
        """Register the sequence's computed full blocks not yet registered (none if not cacheable)."""
        if not seq.cacheable:
            return
        bs, ids = self.allocator.block_size, None
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            ids = ids or seq.all_ids
            k = len(seq.block_hashes)
            h = block_hash(seq.block_hashes[-1] if k else None, ids[k * bs : (k + 1) * bs], self.fingerprint)
            seq.block_hashes.append(h)
            self.allocator.register(seq.block_table[k], h)

    def park(self, seq: Sequence) -> None:
        """Take a running sequence out of scheduling, its blocks held (a KV hand-off's export)."""
        self.running.remove(seq)

    def unpark(self, seq: Sequence) -> None:
        """Schedule a parked (or imported) sequence again, as a running one."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (waiting or running) and free its blocks (and its constraint's matcher)."""
        seq.status = status
        seq.matcher = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.block_table)
