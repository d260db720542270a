"""Prompt encoding off the event loop: chat rendering and tokenization of large inputs in a process pool.

Measured on this project's machines (a 1 MiB user message, SmolLM2's tokenizer):
`tokenizers`' `encode` releases the GIL for its Rust work but not while it builds
the Python result, so a thread running it still stalls the event loop for
140-175 ms; the chat path (jinja2 rendering, the regex that masks special-token
strings, the pieces between special tokens) holds the GIL throughout (a 4.3 s
stall). A thread does not help; a process does. So prompts over `INLINE_CHARS`
characters go to a pool of spawned processes, each holding its own Tokenizer and
ChatTemplate built from the model file's metadata, run at a lower priority
(nice +10) so that tokenizing a large prompt yields the cores to decoding
(hybridgate.encoder_process, the processes' entry points).

Nothing is pickled but the call's envelope: a job is one msgspec-msgpack bytes
object (the text, or the messages) and the answer is b"I" + int32 ids, or b"E" +
the chat template's error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np

from hybridgate import encoder_process

INLINE_CHARS = 8192  # at most this many characters are encoded on the loop (about 2-8 ms here)


class PromptEncoder:
    """Encodes prompts: up to INLINE_CHARS characters at once on the caller's thread, larger ones in
    `processes` pool processes (started on first use); `processes=0` runs them on a thread instead.

    `encode_inline(prompt)` is the router's own encoder (raising its InvalidRequestError);
    `on_error(message)` turns a template error from the pool into that same exception.
    """

    def __init__(self, model_path: str, encode_inline: Callable[[object], list[int]],
                 on_error: Callable[[str], Exception], processes: int):
        self.model_path, self.encode_inline, self.on_error = model_path, encode_inline, on_error
        self.processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    @staticmethod
    def size(prompt: str | Sequence[Mapping[str, str]]) -> int:
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(m.get("content") or "") for m in prompt)

    async def encode(self, prompt: str | Sequence[Mapping[str, str]]) -> Sequence[int]:
        """The prompt's ids (a list; a numpy int32 array when it is too long for the caller to run,
        to spare converting 100,000s of ids). Raises what `encode_inline`/`on_error` raise."""
        if self.size(prompt) <= INLINE_CHARS:
            return self.encode_inline(prompt)
        if self.processes == 0:
            return await asyncio.to_thread(self.encode_inline, prompt)
        job = msgspec.msgpack.encode(prompt if isinstance(prompt, str) else
                                     [{"role": m.get("role"), "content": m.get("content")} for m in prompt])
        # Submitting may spawn a pool process (tens of ms): from a thread, never on the loop.
        future = await asyncio.to_thread(lambda: self._executor().submit(encoder_process.encode, job))
        answer = await asyncio.wrap_future(future)
        if answer[:1] == b"E":
            raise self.on_error(answer[1:].decode())
        return np.frombuffer(answer, dtype=np.int32, offset=1)

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.processes, mp_context=multiprocessing.get_context("spawn"), initializer=encoder_process.init,
                initargs=(self.model_path,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
