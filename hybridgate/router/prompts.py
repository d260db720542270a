"""A request's prompt: its limits, its ids (chat rendering, tokenization), max_tokens and seed.

`Prompts` checks a prompt before any work (`check`: the 1 MiB limits, and a
lower bound of its tokens against the model length), encodes it (`encode`:
small ones at once, large ones off the event loop) and resolves max_tokens
and the seed against the model length (`resolve`).

Encoding off the event loop: chat rendering and tokenization of large inputs in a process pool.

Measured on this project's machines (a 1 MiB user message, SmolLM2's tokenizer):
`tokenizers`' `encode` releases the GIL for its Rust work but not while it builds
the Python result, so a thread running it still stalls the event loop for
140-175 ms; the chat path (jinja2 rendering, the regex that masks special-token
strings, the pieces between special tokens) holds the GIL throughout (a 4.3 s
stall). A thread does not help; a process does. So prompts over `INLINE_CHARS`
characters go to a pool of spawned processes, each holding its own Tokenizer and
ChatTemplate built from the model file's metadata (and the router's template
source, so --chat-template applies to long chats too), run at a lower priority
(nice +10) so that tokenizing a large prompt yields the cores to decoding
(hybridgate.router.encoder_process, the processes' entry points).

Nothing is pickled but the call's envelope: a job is one msgspec-msgpack bytes
object ([the text or the messages, add_generation_prompt, tools]) and the answer is
b"I" + int32 ids, or b"E" + the chat template's error.

A pool process that dies (killed, out of memory) breaks the whole pool
(`BrokenProcessPool` for its jobs and every later one): the broken pool is
dropped and a fresh one started, and the job that met it runs once more there;
a job that breaks the new pool too is refused (`UnavailableError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import msgspec
import numpy as np

from hybridgate.router import encoder_process
from hybridgate.models import ChatTemplate, Tokenizer
from hybridgate.models.chat import ROLES, ChatTemplateError
from hybridgate.router.errors import ContextLengthError, InvalidRequestError, UnavailableError
from hybridgate.wire import SamplingParams

log = logging.getLogger("hybridgate.router")

INLINE_CHARS = 8192  # at most this many characters are encoded on the loop (about 2-8 ms here)
MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_TOKENS_CAP = 4096

class TokenIds(tuple):
    """A prompt given as token ids (vLLM's and OpenAI's completions take a list of ints): run as they are,
    no BOS added, no template; checked against the vocabulary by `Prompts.check`."""


Prompt = str | TokenIds | Sequence[Mapping[str, str]]


def read_chat_template(path: str | None) -> str | None:
    """The text of the --chat-template file (None: the model's own). Raises ValueError naming the flag."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: cannot read {path}: {exc}") from None


class PromptEncoder:
    """Encodes prompts: up to INLINE_CHARS characters at once on the caller's thread, larger ones in
    `processes` pool processes (started on first use); `processes=0` runs them on a thread instead.

    `encode_inline(prompt, add_generation_prompt)` is the router's own encoder (raising its
    InvalidRequestError); `on_error(message)` turns a template error from the pool into that same
    exception. `template`: the chat template's source the router renders with (None: the model's).
    """

    def __init__(self, model_path: str, encode_inline: Callable[[object, bool, list | None], list[int]],
                 on_error: Callable[[str], Exception], processes: int, template: str | None = None):
        self.model_path, self.encode_inline, self.on_error = model_path, encode_inline, on_error
        self.processes, self.template = processes, template
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.restarts = 0  # pools started again after one of their processes died

    @staticmethod
    def size(prompt: str | Sequence[Mapping[str, str]]) -> int:
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(m.get("content") or "") for m in prompt)

    async def encode(self, prompt: str | Sequence[Mapping[str, str]],
                     add_generation_prompt: bool = True, tools: list | None = None) -> Sequence[int]:
        """The prompt's ids (a list; a numpy int32 array when it is too long for the caller to run,
        to spare converting 100,000s of ids). Raises what `encode_inline`/`on_error` raise, and
        UnavailableError when the pool breaks twice on this prompt (see the module doc)."""
        if self.size(prompt) <= INLINE_CHARS:
            return self.encode_inline(prompt, add_generation_prompt, tools)
        if self.processes == 0:
            return await asyncio.to_thread(self.encode_inline, prompt, add_generation_prompt, tools)
        job = msgspec.msgpack.encode([prompt if isinstance(prompt, str) else [dict(m) for m in prompt],
                                      add_generation_prompt, tools])
        try:
            answer = await self._run(job)
        except BrokenProcessPool:
            try:
                answer = await self._run(job)  # on the fresh pool
            except BrokenProcessPool:
                raise UnavailableError("the prompt encoder's processes died twice on this prompt "
                                       "(out of memory?)") from None
        if answer[:1] == b"E":
            raise self.on_error(answer[1:].decode())
        return np.frombuffer(answer, dtype=np.int32, offset=1)

    async def _run(self, job: bytes) -> bytes:
        """One job on the pool; a broken pool is replaced (once per pool, whoever meets it first)
        and BrokenProcessPool raised, for the caller to try once more."""
        # Submitting may spawn a pool process (tens of ms): from a thread, never on the loop.
        pool = await asyncio.to_thread(self._executor)
        try:
            future = await asyncio.to_thread(pool.submit, encoder_process.encode, job)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
                pool.shutdown(wait=False, cancel_futures=True)
                log.warning("a prompt encoder process died; starting the pool afresh")
            raise

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:  # called from threads: one pool at a time
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self.processes, mp_context=multiprocessing.get_context("spawn"),
                    initializer=encoder_process.init, initargs=(self.model_path, self.template))
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class Prompts:
    """The router's prompt handling: limits, ids, and what a request resolves to against the model length.

    `max_model_len`: tokens per sequence, prompt and output together;
    `processes`: the pool that encodes prompts over INLINE_CHARS characters
    (`PromptEncoder`; 0: a thread).
    """

    def __init__(self, model_path: str, tokenizer: Tokenizer, chat_template: ChatTemplate, max_model_len: int,
                 processes: int, template: str | None = None):
        self.tokenizer, self.chat_template, self.max_model_len = tokenizer, chat_template, max_model_len
        self._longest_token = max(map(len, tokenizer.token_bytes), default=1)
        self.encoder = PromptEncoder(model_path, self.tokenize, lambda m: InvalidRequestError("messages", m),
                                     processes, template)

    async def encode(self, prompt: Prompt, add_generation_prompt: bool = True,
                     tools: list | None = None) -> Sequence[int]:
        """`PromptEncoder.encode`: a list, or a numpy int32 array for a prompt too long to run; `tools`: the
        chat template's tools (`hybridgate.router.tools`). Token ids are their own encoding."""
        if isinstance(prompt, TokenIds):
            return list(prompt)
        return await self.encoder.encode(prompt, add_generation_prompt, tools)

    def close(self) -> None:
        self.encoder.close()

    def check(self, prompt: Prompt) -> None:
        """Raises InvalidRequestError naming the field: an empty prompt or chat, a message that is not a
        string or has an unknown role, over 1 MiB, or one certain to exceed the model length; token ids that
        are empty or outside the vocabulary."""
        if isinstance(prompt, TokenIds):
            vocab = self.tokenizer.vocab_size
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)), None)
            if bad is not None:
                raise InvalidRequestError("prompt", f"every token id must be in [0, {vocab}), got {bad!r}")
            return
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            size = len(prompt.encode("utf-8"))
            if size > MAX_PROMPT_BYTES:
                raise InvalidRequestError("prompt", f"at most 1 MiB ({MAX_PROMPT_BYTES} bytes), got {size} bytes")
            self._check_bound(size)
            return
        if not prompt:
            raise InvalidRequestError("messages", "at least one message is required")
        if not any(isinstance(m.get("content"), str) and m["content"].strip() for m in prompt):
            raise InvalidRequestError("messages", "every message content is empty")
        total = 0
        for i, m in enumerate(prompt):
            if m.get("role") not in ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
            content = m.get("content")
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string")
            size = len(content.encode("utf-8"))
            if size > MAX_PROMPT_BYTES:
                raise InvalidRequestError(f"messages[{i}].content", f"at most 1 MiB ({MAX_PROMPT_BYTES} bytes), got {size} bytes")
            total += size
        self._check_bound(total)

    def _check_bound(self, size: int) -> None:
        """A prompt of `size` bytes has at least size / (the longest token's bytes) tokens, since a
        byte-level BPE token stands for at most that many bytes: one certain to exceed the model
        length is refused before seconds of tokenizing."""
        fewest = -(-size // self._longest_token)
        if fewest >= self.max_model_len:
            raise InvalidRequestError("prompt", f"{size} bytes are at least {fewest} tokens (no token of this model "
                                      f"is longer than {self._longest_token} bytes), but the max model length is "
                                      f"{self.max_model_len} tokens (prompt and output together)")

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True, tools: list | None = None) -> list[int]:
        """The prompt's ids on this thread: raw text as `Tokenizer.encode_prompt` (BOS when the vocabulary
        asks for it), chat messages through the template, token ids as they are. Raises InvalidRequestError on
        a template error."""
        if isinstance(prompt, TokenIds):
            return list(prompt)
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        try:
            return self.chat_template.encode(prompt, add_generation_prompt, tools)
        except ChatTemplateError as exc:
            raise InvalidRequestError("messages", str(exc)) from exc

    def resolve(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """(max_tokens, seed) for this request, checked against the model length."""
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise ContextLengthError("prompt", f"{n} tokens, but the max model length is {limit} tokens "
                                      "(prompt and output together)")
        max_tokens = params.max_tokens or min(limit - n, DEFAULT_MAX_TOKENS_CAP)
        if n + max_tokens > limit:
            raise ContextLengthError("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                                      f"{n + max_tokens} exceeds the max model length of {limit} tokens")
        if params.min_tokens > max_tokens:  # max_tokens defaulted (a given one was checked by validate)
            raise InvalidRequestError("min_tokens", f"must be at most max_tokens ({max_tokens}: the rest of the "
                                      f"context or the default cap), got {params.min_tokens}")
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        return max_tokens, seed
