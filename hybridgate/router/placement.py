"""The router's side of placement: worker loads from reports and its own record, and the chosen plan.

Every placement of a request goes through `Placer.place`: the first one, and
every later one (a retry after a refusal or a failed send, a resume after a
lost worker, a stall or Overload move, an explicit route), each with the
workers to leave out and the ids already streamed. It builds one `WorkerLoad`
per eligible READY worker from its last load report (`client.stats`, its
HELLO's `kv_dtype`) and from what this router sent there and has not seen
answered yet (requests without a first token count their uncached prompt
tokens as queued; requests past it count as decoding), estimates each
worker's cached prefix of the tokens to prefill from the block hashes this
router sent it (the same chained hashes the workers' prefix caches use), and
asks the policy (hybridgate/router/policy.py).

Per-worker records are keyed by the client object itself (hashed by
identity and held here, so a key is never reused the way `id()` of a freed
object is) and dropped with the worker (`drop`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridgate.mempool import DEFAULT_BLOCK_SIZE, prefix_block_hashes
from hybridgate.router.costmodel import HandoffRate, WorkerLoad, kv_bytes_per_value
from hybridgate.router.errors import UnavailableError
from hybridgate.router.policy import Plan, PlacementRequest, Policy, all_plans
from hybridgate.wire import WorkerState

HASHES_PER_WORKER = 1 << 16  # block hashes remembered per worker (LRU); ~1M tokens of prefixes


@dataclass(frozen=True)
class Placement:
    """A request's placement, as returned to the caller (final message, trailing metadata, metrics).

    `clients`: the chosen workers (one, or the GPU then the CPU worker of a
    hand-off); `fastest_ttft_s`: the lowest TTFT any plan predicted (the
    deadline check's figure).
    """

    policy: str
    plan: Plan
    clients: tuple
    fastest_ttft_s: float
    uncached_tokens: int  # the prompt tokens the first chosen worker is expected to compute

    @property
    def route(self) -> str:
        return self.plan.route


@dataclass
class _Pending:
    """One of this router's requests on a worker, as the placement record sees it."""

    uncached_tokens: int
    started: bool = False  # its first token arrived
    final_tokens: int = 0  # tokens of KV it holds there at its end (for `WorkerLoad.blocks_committed`)


@dataclass
class _Worker:
    """This router's record of one worker: requests in flight and block hashes sent there."""

    inflight: int = 0
    hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)


class Placer:
    """Holds the policy and this router's record of what it sent to each worker.

    `kv_values_per_token`: K and V elements of one token in any cache of this
    model (2 × layers × KV heads × head dim); a worker's bytes per token are
    that times the size of its reported `kv_dtype`.
    """

    def __init__(self, policy: Policy, fingerprint: str, kv_values_per_token: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, handoff_rate: HandoffRate | None = None):
        self.policy, self.fingerprint, self.block_size = policy, fingerprint, block_size
        self.kv_values_per_token = kv_values_per_token
        self.handoff_rate = handoff_rate or HandoffRate()
        self._workers: dict[object, _Worker] = {}

    # --- the record ---

    def _of(self, client) -> _Worker:
        record = self._workers.get(client)
        if record is None:
            record = self._workers[client] = _Worker()
        return record

    def inflight(self, client) -> int:
        """This router's requests on `client` now."""
        record = self._workers.get(client)
        return record.inflight if record is not None else 0

    def sent(self, client) -> None:
        self._of(client).inflight += 1

    def ended(self, client) -> None:
        record = self._workers.get(client)
        if record is not None and record.inflight > 0:
            record.inflight -= 1

    def forget(self, client) -> None:
        """The worker restarted: its cache is empty."""
        record = self._workers.get(client)
        if record is not None:
            record.hashes.clear()

    def drop(self, client) -> None:
        """The worker left: nothing of it is kept."""
        self._workers.pop(client, None)

    # --- placing ---

    def place(self, clients: Sequence, pending: Mapping[object, Iterable[_Pending]], prompt_ids: Sequence[int],
              max_tokens: int, deadline_s: float | None = None, *, exclude: Iterable = (),
              streamed: Sequence[int] = (), kind: str | None = None, handoff: bool = True) -> Placement:
        """The policy's plan over the READY `clients` not in `exclude` (and of `kind`, when given).

        `streamed`: ids already streamed to the caller; a resume prefills
        `prompt_ids + streamed` and generates `max_tokens - len(streamed)`.
        `handoff`: whether a gpu->cpu plan may be chosen (first placements of
        route "auto" only). The chosen worker's block hashes are recorded as
        sent. Raises UnavailableError when no worker is eligible.
        """
        excluded = set(exclude)
        eligible = [c for c in clients if c.state == WorkerState.READY and c not in excluded
                    and (kind is None or c.kind == kind)]
        if not eligible:
            raise UnavailableError(f"no {kind} worker is ready" if kind else "no worker is ready")
        tokens = list(prompt_ids) + list(streamed)
        hashes = prefix_block_hashes(tokens, self.fingerprint, self.block_size, (len(tokens) - 1) // self.block_size)
        uncached = tuple(len(tokens) - self.block_size * self._cached_blocks(c, hashes) for c in eligible)
        loads = [self._load(i, c, pending.get(c, ())) for i, c in enumerate(eligible)]
        request = PlacementRequest(len(tokens), max(1, max_tokens - len(streamed)), uncached, deadline_s,
                                   self.handoff_rate.bytes_per_s(), handoff)
        plan = self.policy.place(request, loads)
        fastest = min(p.ttft_s for p in all_plans(request, loads))
        chosen = tuple(eligible[i] for i in plan.workers)
        self._remember(chosen[0], hashes)
        return Placement(self.policy.name, plan, chosen, fastest, uncached[plan.workers[0]])

    def _cached_blocks(self, client, hashes: list[bytes]) -> int:
        record = self._workers.get(client)
        n = 0
        while record is not None and n < len(hashes) and hashes[n] in record.hashes:
            n += 1
        return n

    def _remember(self, client, hashes: list[bytes]) -> None:
        sent = self._of(client).hashes
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > HASHES_PER_WORKER:
            sent.popitem(last=False)

    def _load(self, index: int, client, pending: Iterable[_Pending]) -> WorkerLoad:
        """The worker as the policy sees it; its scheduler limits come from its report alone (0 when it
        has sent none: `WorkerLoad` prices that without them)."""
        s, hello = client.stats, getattr(client, "hello", None)
        queued = waiting = decoding = committed = 0  # over `pending` in one pass: one per request in flight
        for p in pending:
            if p.started:
                decoding += 1
            else:
                waiting, queued = waiting + 1, queued + p.uncached_tokens
            committed += -(-p.final_tokens // self.block_size)
        kv_dtype = hello.kv_dtype if hello is not None else ""
        return WorkerLoad(
            index=index, name=getattr(client, "name", "") or client.endpoint, kind=client.kind or "",
            inflight=self.inflight(client), queued_prefill_tokens=max(s.queued_prefill_tokens, queued),
            waiting=max(s.waiting, waiting), decoding=max(s.decoding, decoding),
            blocks_free=(s.blocks_total - s.blocks_used) if s.blocks_total else 1 << 30,
            blocks_total=s.blocks_total or 1 << 30, block_size=self.block_size,
            blocks_committed=max(s.blocks_committed, committed),
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            prefill_tokens_per_s=s.prefill_tokens_per_s, decode_step_s=s.decode_step_s,
            takes_handoff=bool(getattr(hello, "handoff_endpoint", "")) and client.kind == "cpu",
            kv_bytes_per_token=self.kv_values_per_token * kv_bytes_per_value(kv_dtype))
