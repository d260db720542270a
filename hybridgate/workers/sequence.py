"""A sequence in the engine: its ids, parameters and an ordered status."""

from __future__ import annotations

import enum
import time
from hybridgate.wire import AddRequest, FinishReason, SamplingParams, TokenLogprobs


class SequenceStatus(enum.IntEnum):
    """Ordered, so `status >= FINISHED_STOPPED` is "finished"."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_EOS = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_OF_STATUS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_EOS: FinishReason.EOS,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Sequence:
    """One request inside a worker. `client` names the router to answer."""

    def __init__(self, request: AddRequest, client: bytes = b""):
        self.request_id = request.request_id
        self.client = client
        self.prompt_ids: list[int] = list(request.prompt_ids)
        self.output_ids: list[int] = []
        # One per output id when the request asks for logprobs (None for ids another worker sampled).
        self.output_logprobs: list[TokenLogprobs | None] = []
        self.params: SamplingParams = request.params
        self.seed = request.seed
        self.max_tokens = request.max_tokens
        self.eos_token_id = request.eos_token_id
        self.status = SequenceStatus.WAITING
        self.arrival = time.monotonic()
        # Monotonic time past which it is dropped if it has not run yet (None: no deadline).
        self.deadline = self.arrival + request.deadline_s if request.deadline_s > 0 else None
        self.queue_ms = 0.0
        self.num_computed = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []  # KV blocks, in order (the scheduler's allocator owns them)
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks registered so far
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first scheduling
        self.scheduled_once = False
        self.sent = 0  # output ids already sent to the router
        # A resumed stream (DESIGN.md, Worker lifecycle): prompt_ids end with the ids the
        # client already has, and this sequence's outputs continue at this token index.
        self.first_token_index = request.first_token_index
        self.handoff = request.handoff  # gpu->cpu: export after the first token (GPU worker)
        self.imported = False  # its KV came from a hand-off (CPU worker): preempted last
        self.cacheable = True  # its blocks may enter the prefix cache (not for imported KV unless configured)
        # With a constraint: its llguidance matcher, fed every generated id (None until its grammar is
        # compiled, and again once it finishes; `hybridgate.workers.constraints`).
        self.matcher = None
        # An embedding request (a PoolingType; 0: a generation): prefill only, its final-norm hidden states
        # summed across chunks (`hybridgate.workers.pooling`), answered as `embedding` bytes when finished.
        self.pooling = request.pooling
        self.pool_sum = None  # float64 [hidden] once a chunk ran
        self.embedding = b""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def next_token_index(self) -> int:
        """Index, among the request's generated tokens, of the token sampled next: it keys the
        sampling noise, so a resumed sequence draws the noise the undisturbed one would."""
        return self.first_token_index + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def generated_ids(self) -> list[int]:
        """Every id generated for the request, a resumed stream's earlier ones (the tail of its prompt) too:
        what the presence and frequency penalties count."""
        n = self.next_token_index
        return self.all_ids[-n:] if n else []

    def append(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Add a sampled id (and its logprobs, when asked) and finish on EOS, a stop token id or max_tokens."""
        self.output_ids.append(token_id)
        if self.params.logprobs is not None:
            self.output_logprobs.append(logprobs)
        if token_id == self.eos_token_id and not self.params.ignore_eos:
            self.status = SequenceStatus.FINISHED_EOS
        elif token_id in self.params.stop_token_ids:
            self.status = SequenceStatus.FINISHED_STOPPED
        elif len(self.output_ids) >= self.max_tokens:
            self.status = SequenceStatus.FINISHED_LENGTH
