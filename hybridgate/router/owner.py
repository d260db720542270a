"""What the router's parts call of their `Router`, as small Protocols (PEP 544).

`GenerationStream`, the embedding requests and `RedisRegistry` are handed the
`Router` that runs them and call a few of its attributes. Naming those here,
instead of importing `hybridgate.router.router.Router` (which imports them),
keeps the import graph free of cycles even for a type checker, which reads the
imports under `if TYPE_CHECKING:` too (tests/unit/test_imports.py). `Router`
satisfies each Protocol structurally; nothing subclasses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from hybridgate.clients.interface import WorkerClient
    from hybridgate.models import GGUFModel, Tokenizer
    from hybridgate.router.config import RouterConfig
    from hybridgate.router.constraints import ConstraintCheck
    from hybridgate.router.handoff import HandoffMetrics, PauseHook
    from hybridgate.router.placement import Placement
    from hybridgate.router.prompts import Prompts
    from hybridgate.wire import SamplingParams

S = TypeVar("S", contravariant=True)  # the stream type the owner keeps (GenerationStream)


class StreamOwner(Protocol[S]):
    """What a stream of type `S` calls of its router: the settings, tokenizer, prompt encoder and
    constraint check; the request's limits (`resolve`) and placement (`plan`); and the router's table
    of which stream runs on which worker (`register`, `unregister`, `reassign`)."""

    config: RouterConfig
    tokenizer: Tokenizer
    constraints: ConstraintCheck
    prompts: Prompts
    max_model_len: int
    handoff_metrics: HandoffMetrics
    handoff_pause: PauseHook

    def resolve(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, int]: ...

    def plan(self, prompt_ids: list[int], max_tokens: int, deadline_s: float | None = None, *,
             exclude: Sequence[WorkerClient] = (), streamed: Sequence[int] = (), kind: str | None = None,
             handoff: bool = True) -> Placement: ...

    def register(self, stream: S, client: WorkerClient | None) -> None: ...

    def unregister(self, stream: S, client: WorkerClient | None) -> None: ...

    def reassign(self, stream: S, old: WorkerClient, new: WorkerClient) -> None: ...


class EmbeddingOwner(StreamOwner[S], Protocol[S]):
    """What an embedding request calls of its router: a stream owner's, and the model (its hidden size
    and the file's pooling type)."""

    model: GGUFModel


class Members(Protocol):
    """What the worker registry calls of its router: the model's fingerprint (a worker with another is
    refused) and adding and dropping a worker's client."""

    fingerprint: str

    async def add_client(self, client: WorkerClient) -> None: ...

    async def drop_client(self, client: WorkerClient, reason: str) -> None: ...
