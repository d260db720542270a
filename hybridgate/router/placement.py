"""The router's side of placement: worker loads from reports and its own record, and the chosen plan.

`Placer.place` builds one `WorkerLoad` per READY worker from its last load
report (`client.stats`) and from what this router sent there and has not seen
answered yet (requests without a first token count their uncached prompt
tokens as queued; requests past it count as decoding), estimates each
worker's cached prefix of the prompt from the block hashes this router sent
it (the same chained hashes the workers' prefix caches use), and asks the
policy (hybridgate/router/policy.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hybridgate.mempool import DEFAULT_BLOCK_SIZE, prefix_block_hashes
from hybridgate.router.costmodel import WorkerLoad
from hybridgate.router.policy import Plan, PlacementRequest, Policy, all_plans
from hybridgate.workerconf import SchedulerConfig

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


class Placer:
    """Holds the policy and this router's record of what it sent to each worker."""

    def __init__(self, policy: Policy, fingerprint: str, kv_bytes_per_token: int,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.policy, self.fingerprint, self.block_size = policy, fingerprint, block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self._hashes: dict[int, OrderedDict[bytes, None]] = {}  # id(client) → block hashes sent there

    def place(self, clients: Sequence, inflight: dict[int, int], pending: dict[int, Iterable[_Pending]],
              prompt_ids: Sequence[int], max_tokens: int, deadline_s: float | None = None) -> Placement:
        """The policy's plan over `clients` (READY, non-empty); the hashes are recorded as sent."""
        hashes = prefix_block_hashes(prompt_ids, self.fingerprint, self.block_size,
                                     (len(prompt_ids) - 1) // self.block_size)
        uncached = tuple(len(prompt_ids) - self.block_size * self._cached_blocks(c, hashes) for c in clients)
        loads = [self._load(i, c, inflight.get(id(c), 0), pending.get(id(c), ())) for i, c in enumerate(clients)]
        request = PlacementRequest(len(prompt_ids), max_tokens, uncached, deadline_s, self.kv_bytes_per_token)
        plan = self.policy.place(request, loads)
        fastest = min(p.ttft_s for p in all_plans(request, loads))
        chosen = tuple(clients[i] for i in plan.workers)
        self._remember(chosen[0], hashes)
        return Placement(self.policy.name, plan, chosen, fastest, uncached[plan.workers[0]])

    def _cached_blocks(self, client, hashes: list[bytes]) -> int:
        sent = self._hashes.get(id(client))
        n = 0
        while sent is not None and n < len(hashes) and hashes[n] in sent:
            n += 1
        return n

    def _remember(self, client, hashes: list[bytes]) -> None:
        sent = self._hashes.setdefault(id(client), OrderedDict())
        for h in hashes:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > HASHES_PER_WORKER:
            sent.popitem(last=False)

    def forget(self, client) -> None:
        """The worker restarted: its cache is empty."""
        self._hashes.pop(id(client), None)

    def _load(self, index: int, client, inflight: int, pending: Iterable[_Pending]) -> WorkerLoad:
        s, hello = client.stats, getattr(client, "hello", None)
        pending = list(pending)
        queued = sum(p.uncached_tokens for p in pending if not p.started)
        decoding = sum(1 for p in pending if p.started)
        return WorkerLoad(
            index=index, name=getattr(client, "name", "") or client.endpoint, kind=client.kind or "",
            inflight=inflight, queued_prefill_tokens=max(s.queued_prefill_tokens, queued),
            waiting=max(s.waiting, sum(1 for p in pending if not p.started)), decoding=max(s.decoding, decoding),
            blocks_free=(s.blocks_total - s.blocks_used) if s.blocks_total else 1 << 30,
            blocks_total=s.blocks_total or 1 << 30, block_size=self.block_size,
            blocks_committed=max(s.blocks_committed, sum(-(-p.final_tokens // self.block_size) for p in pending)),
            max_num_seqs=s.max_num_seqs or (hello.max_num_seqs if hello is not None else SchedulerConfig.max_num_seqs),
            max_num_batched_tokens=s.max_num_batched_tokens or SchedulerConfig.max_num_batched_tokens,
            prefill_tokens_per_s=s.prefill_tokens_per_s, decode_step_s=s.decode_step_s,
            takes_handoff=bool(getattr(hello, "handoff_endpoint", "")) and client.kind == "cpu")
