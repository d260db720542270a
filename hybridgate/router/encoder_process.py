"""Entry points of the prompt encoder's pool processes (hybridgate.router.prompts).

This module imports only the standard library at its top, so that a spawned pool
process lowers its priority (nice +10) before it imports numpy, tokenizers and
gguf and builds the tokenizer: even starting up, it yields the cores to the
worker's decode steps and the gateway's event loop.

A job is one msgspec-msgpack bytes object ([the text or the messages,
add_generation_prompt, the template's tools or None]); the answer
is b"I" + the ids as int32 bytes, or b"E" + the chat template's error message.
"""

from __future__ import annotations

import os
import signal

NICE = 10

_state: dict = {}  # the model's tokenizer and chat template, built once per process


def init(model_path: str, template: str | None = None) -> None:
    """Pool initializer: ignore Ctrl-C, lower the priority, then build the tokenizer of `model_path`
    and its chat template (`template`'s source, the router's --chat-template; None: the model's). A terminal's Ctrl-C reaches the whole process group; the gateway decides when the
    pool ends (a traceback from each pool process was all SIGINT gave)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:  # not permitted: encode at the same priority
        pass
    from hybridgate.models import ChatTemplate, Tokenizer, load_gguf
    from hybridgate.models.chat import template_token_ids

    model = load_gguf(model_path)
    tokenizer = Tokenizer.from_model(model)
    _state.update(tokenizer=tokenizer, chat=ChatTemplate(tokenizer, template, template_token_ids(model.metadata)))


def encode(job: bytes) -> bytes:
    """Render (messages) and tokenize one prompt; see the module doc for the formats."""
    import msgspec
    import numpy as np

    from hybridgate.models.chat import ChatTemplateError

    prompt, add_generation_prompt, tools = msgspec.msgpack.decode(job)
    try:
        ids = _state["tokenizer"].encode_prompt(prompt) if isinstance(prompt, str) else \
            _state["chat"].encode(prompt, add_generation_prompt, tools)
    except ChatTemplateError as exc:
        return b"E" + str(exc).encode()
    return b"I" + np.asarray(ids, dtype=np.int32).tobytes()
