"""Incremental detokenization that never emits a broken UTF-8 sequence."""

from __future__ import annotations

import codecs

from hybridgate.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turn generated ids, one at a time, into text deltas.

    A byte-level BPE token decodes to fixed bytes whatever precedes it, so the
    text of the generated ids never depends on the prompt: this starts at the
    first generated id and no prompt text can leak into the output (unlike the
    prefix/read-offset scheme that SentencePiece vocabularies need, see vLLM's
    `detokenize_incrementally`). Bytes that may still become a valid character
    are held back; `flush()` emits them as U+FFFD, so deltas + flush equal
    `tokenizer.decode(ids)` (UTF-8 decoded with replacement, maximal subparts).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._token_bytes = tokenizer.token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text_offset = 0  # characters emitted so far; never moves back

    def step(self, token_id: int) -> str:
        """The new text that `token_id` completes ('' while a character is partial)."""
        delta = self._decoder.decode(self._token_bytes[token_id])
        self.text_offset += len(delta)
        return delta

    def flush(self) -> str:
        """End of stream: held-back bytes as U+FFFD ('' if none)."""
        delta = self._decoder.decode(b"", final=True)
        self.text_offset += len(delta)
        return delta
