"""Prompt encoding off the event loop: chat rendering and tokenization of large inputs in a process pool.

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
(hybridgate.encoder_process, the processes' entry points).

Nothing is pickled but the call's envelope: a job is one msgspec-msgpack bytes
object ([the text or the messages, add_generation_prompt]) and the answer is
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
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool

import msgspec
import numpy as np

from hybridgate import encoder_process
from hybridgate.router.errors import UnavailableError

log = logging.getLogger("hybridgate.router")

INLINE_CHARS = 8192  # at most this many characters are encoded on the loop (about 2-8 ms here)


class PromptEncoder:
    """Encodes prompts: up to INLINE_CHARS characters at once on the caller's thread, larger ones in
    `processes` pool processes (started on first use); `processes=0` runs them on a thread instead.

    `encode_inline(prompt, add_generation_prompt)` is the router's own encoder (raising its
    InvalidRequestError); `on_error(message)` turns a template error from the pool into that same
    exception. `template`: the chat template's source the router renders with (None: the model's).
    """

    def __init__(self, model_path: str, encode_inline: Callable[[object, bool], list[int]],
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
                     add_generation_prompt: bool = True) -> Sequence[int]:
        """The prompt's ids (a list; a numpy int32 array when it is too long for the caller to run,
        to spare converting 100,000s of ids). Raises what `encode_inline`/`on_error` raise, and
        UnavailableError when the pool breaks twice on this prompt (see the module doc)."""
        if self.size(prompt) <= INLINE_CHARS:
            return self.encode_inline(prompt, add_generation_prompt)
        if self.processes == 0:
            return await asyncio.to_thread(self.encode_inline, prompt, add_generation_prompt)
        job = msgspec.msgpack.encode([prompt if isinstance(prompt, str) else
                                      [{"role": m.get("role"), "content": m.get("content")} for m in prompt],
                                      add_generation_prompt])
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
