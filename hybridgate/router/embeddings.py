"""Embedding requests: each input a prefill-only request on the same workers, pooled there, normalised here.

Each input (text or token ids) becomes one `EmbeddingStream`: a `GenerationStream` whose ADD carries the
pooling type (`AddRequest.pooling`), placed by the policy by its size like any prompt (never handed
off), moved when its worker is lost, and batched by the worker with generations in the same steps. The
worker answers the pooled final-norm hidden state (`SeqOutput.embedding`); the router truncates it to
`dimensions` (Matryoshka representation learning, Kusupati et al. 2022: the leading components, then
normalised, as Qwen3-Embedding and sentence-transformers' `truncate_dim` do) and L2-normalises it
(RouterConfig.embedding_normalize). Embedding requests skip the response cache: their answer is one
vector, not a stream to replay, and a repeat costs a prefill (whose blocks the prefix cache may hold).

Text inputs are tokenized as a completion's raw text (BOS where the vocabulary asks) with EOS appended
where the file's `tokenizer.ggml.add_eos_token` says (as llama.cpp's embedding path does: Qwen3-Embedding
pools the last token, its `<|endoftext|>`); token ids run as they are.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridgate.router.errors import InvalidRequestError, WorkerRequestError
from hybridgate.router.prompts import TokenIds
from hybridgate.router.stream import GenerationStream
from hybridgate.wire import PoolingType, SamplingParams, SeqOutput

if TYPE_CHECKING:
    from hybridgate.router.owner import EmbeddingOwner

    Owner = EmbeddingOwner[GenerationStream]  # the Router, as these functions use it

MAX_INPUTS = 2048  # inputs of one request (OpenAI's limit for an embeddings request's array)
EMBED_ROUTES = ("auto", "gpu", "cpu")
_PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1)  # one KV slot past the prompt is all it asks


@dataclass(frozen=True)
class Embeddings:
    """One request's answer: a float32 vector `[dimensions]` per input, in input order, and the prompt tokens
    they took (OpenAI's `usage.prompt_tokens`, which is also its `total_tokens`)."""

    vectors: list[np.ndarray]
    prompt_tokens: int


def pooling_of(router: Owner) -> PoolingType:
    """The pooling embedding requests use: RouterConfig.pooling, or the file's `<arch>.pooling_type`.

    Raises InvalidRequestError (field `model`) when that is none or one not served (RANK: a reranker)."""
    setting = router.config.pooling
    if setting != "file":
        return PoolingType[setting.upper()]
    value = router.model.config.pooling_type
    if value not in (PoolingType.MEAN, PoolingType.CLS, PoolingType.LAST):
        arch = router.model.config.architecture
        raise InvalidRequestError("model", f"this model serves no embeddings: its GGUF's {arch}.pooling_type is "
                                  f"{value} ({'none' if value == 0 else 'not mean, cls or last'}); serve it with "
                                  "--pooling mean, cls or last to pool its final hidden states")
    return PoolingType(value)


def check_dimensions(router: Owner, dimensions: int | None) -> int:
    """The vector length to answer: the model's hidden size, or `dimensions` within it where the model
    supports truncation (RouterConfig.matryoshka). Raises InvalidRequestError naming `dimensions`."""
    hidden = router.model.config.hidden_size
    if dimensions is None or dimensions == hidden:
        return hidden
    if not router.config.matryoshka:
        raise InvalidRequestError("dimensions", f"this model's embeddings have {hidden} dimensions and it was not "
                                  "trained to be truncated (serve it with --matryoshka if it was); leave dimensions "
                                  f"out or give {hidden}, got {dimensions}")
    if not 1 <= dimensions <= hidden:
        raise InvalidRequestError("dimensions", f"must be in [1, {hidden}], got {dimensions}")
    return dimensions


class EmbeddingStream(GenerationStream):
    """A prefill-only stream: its one output carries the pooled vector (`embedding`), no token."""

    def __init__(self, router: Owner, prompt: str | TokenIds, pooling: PoolingType, label: str, route: str,
                 deadline_s: float | None):
        super().__init__(router, prompt, _PREFILL_ONLY, label, request_id=uuid.uuid4().hex, route=route,
                         deadline_s=deadline_s)
        self.pooling = int(pooling)
        self.embedding = b""

    async def prepare(self) -> None:
        if self._prepared:
            return
        await super().prepare()
        tok = self.router.tokenizer
        if isinstance(self.prompt, str) and tok.add_eos_token and tok.eos_token_id >= 0:
            self.prompt_ids = [*self.prompt_ids, tok.eos_token_id]
            self.max_tokens, self.seed = self.router.resolve(self.prompt_ids, self.params)

    def _on_output(self, out: SeqOutput):
        if out.embedding:
            self.embedding = out.embedding
        return super()._on_output(out)

    async def vector(self) -> np.ndarray:
        """Enter, read to the end, and return the pooled vector (float32 `[hidden]`, not normalised)."""
        async with self:
            async for _ in self:
                pass
        if not self.embedding:
            raise WorkerRequestError(f"request {self.request_id}: the worker finished it without an embedding")
        return np.frombuffer(self.embedding, "<f4")


def finish_vector(pooled: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """float32 `[dimensions]`: the leading components of `pooled`, L2-normalised when `normalize` (a zero
    vector stays zero)."""
    v = pooled[:dimensions].astype(np.float64)
    if normalize:
        norm = np.linalg.norm(v)
        v = v / norm if norm > 0 else v
    return v.astype(np.float32)


async def embed(router: Owner, inputs: Sequence[str | TokenIds], dimensions: int | None = None, label: str = "",
                route: str = "auto", deadline_s: float | None = None) -> Embeddings:
    """The embeddings of `inputs` (see the module doc). Raises InvalidRequestError naming the field (`input`,
    `dimensions`, `model`, `route`) before any work, and what a generation's stream raises (UnavailableError,
    ResourceExhaustedError, DeadlineExceededError) once placed; one input's failure aborts the others."""
    if not 1 <= len(inputs) <= MAX_INPUTS:
        raise InvalidRequestError("input", f"give 1 to {MAX_INPUTS} inputs, got {len(inputs)}")
    pooling = pooling_of(router)
    dims = check_dimensions(router, dimensions)
    if route not in EMBED_ROUTES:
        raise InvalidRequestError("route", f"an embedding runs on one worker: one of {', '.join(EMBED_ROUTES)}, "
                                  f"got {route!r}")
    for i, prompt in enumerate(inputs):
        try:
            router.prompts.check(prompt)
        except InvalidRequestError as exc:
            field = f"input[{i}]" if len(inputs) > 1 else "input"
            raise InvalidRequestError(field, str(exc).removeprefix(exc.field + ": ")) from None
    streams = [EmbeddingStream(router, p, pooling, label, route, deadline_s) for p in inputs]
    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels (and so aborts) the rest
            tasks = [group.create_task(s.vector()) for s in streams]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    vectors = [finish_vector(t.result(), dims, router.config.embedding_normalize) for t in tasks]
    return Embeddings(vectors, sum(len(s.prompt_ids) for s in streams))
