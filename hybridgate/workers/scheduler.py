"""Continuous batching: which sequences run in the next step. A pure state machine.

New prompts join between steps and finished sequences leave, as in Orca (Yu et
al., OSDI 2022); a step may hold prefills and decodes together. The scheduler
knows no sockets and no devices: tests drive it with fake model outputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybridgate.workers.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledBatch:
    """One step: each entry is (sequence, number of new tokens to run)."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def sequences(self) -> list[Sequence]:
        return [s for s, _ in self.prefills] + self.decodes

    def __len__(self) -> int:
        return len(self.prefills) + len(self.decodes)


class Scheduler:
    """Waiting and running queues; `schedule()` picks a step, `finish()` retires sequences."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Decodes of all running sequences, then whole prompts while the budget lasts.

        A prompt longer than the token budget still runs when nothing else
        would (chunked prefill is a later issue).
        """
        batch = ScheduledBatch(decodes=list(self.running))
        budget = self.config.max_num_batched_tokens - len(batch.decodes)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens - seq.num_computed
            if n > budget and len(batch):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence (any status >= FINISHED_STOPPED); it may be waiting or running."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None
