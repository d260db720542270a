"""Incremental detokenization that never emits a broken UTF-8 sequence."""

from __future__ import annotations

from hybridgate.models.tokenizer import Tokenizer

# Unicode 15, Table 3-7 (well-formed UTF-8): for each lead byte, the sequence
# length and the range allowed for the second byte (later bytes: 80..BF).
_LEADS: dict[int, tuple[int, int, int]] = {}
for _b in range(0xC2, 0xE0):
    _LEADS[_b] = (2, 0x80, 0xBF)
for _b in range(0xE0, 0xF0):
    _LEADS[_b] = (3, 0xA0 if _b == 0xE0 else 0x80, 0x9F if _b == 0xED else 0xBF)
for _b in range(0xF0, 0xF5):
    _LEADS[_b] = (4, 0x90 if _b == 0xF0 else 0x80, 0x8F if _b == 0xF4 else 0xBF)


def _incomplete_tail(buf: bytes) -> int:
    """Length of the trailing bytes that are a proper prefix of a well-formed character (0-3)."""
    for start in range(len(buf) - 1, max(len(buf) - 4, -1), -1):
        if not 0x80 <= buf[start] <= 0xBF:  # the last byte that is not a continuation byte
            lead = _LEADS.get(buf[start])
            tail = buf[start:]
            if lead is None or len(tail) >= lead[0]:
                return 0
            if len(tail) > 1 and not lead[1] <= tail[1] <= lead[2]:
                return 0
            if any(not 0x80 <= b <= 0xBF for b in tail[2:]):
                return 0
            return len(tail)
    return 0


class IncrementalDetokenizer:
    """Turn generated ids, one at a time, into text deltas.

    A byte-level BPE token decodes to fixed bytes whatever precedes it, so the
    text of the generated ids never depends on the prompt: this starts at the
    first generated id and no prompt text can leak into the output (unlike the
    prefix/read-offset scheme that SentencePiece vocabularies need, see vLLM's
    `detokenize_incrementally`). Only bytes that may still become a valid
    character (a proper prefix of a well-formed sequence, Unicode Table 3-7)
    are held back; everything else is decoded at once, invalid bytes as
    U+FFFD per maximal subpart, as `tokenizer.decode` does. `flush()` emits the
    held bytes as U+FFFD, so deltas + flush equal `tokenizer.decode(ids)`;
    except that on a SentencePiece vocabulary with a space prefix, `decode`
    drops the leading space of the first `▁` piece (text that starts a
    prompt) where the deltas keep it (text that continues one, as llama.cpp's
    `token_to_piece` streams it). A SentencePiece token's bytes are as fixed
    as a byte-level one's (`▁` is a space, `<0xNN>` its byte).

    With `skip_special_tokens`, special (control) tokens such as `<|im_end|>`
    add no bytes, as if absent from the ids, so deltas + flush equal
    `tokenizer.decode(ids, skip_special_tokens=True)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._token_bytes = tokenizer.token_bytes
        self._token_texts = tokenizer.token_texts  # shared by every stream of the tokenizer
        self._skipped = frozenset(tokenizer.special_tokens.values()) if skip_special_tokens else frozenset()
        self._pending = b""
        self.text_offset = 0  # characters emitted so far; never moves back

    def step(self, token_id: int) -> str:
        """The new text that `token_id` completes ('' while a character is partial)."""
        if token_id in self._skipped:
            return self._take(b"")
        text = self._token_texts[token_id] if not self._pending else None
        if text is None:  # part of a character, or bytes held back before it: through the buffer
            return self._take(self._token_bytes[token_id])
        self.text_offset += len(text)  # whole characters after whole characters: the token's own text
        return text

    def steps(self, token_ids) -> str:
        """The new text of several ids at once: equal to joining `step()` of each, at one decode.

        Equal because a step emits everything but a proper prefix of a
        well-formed character, and the UTF-8 decoder's choices (U+FFFD per
        maximal subpart) never look past such a boundary."""
        if len(token_ids) == 1:  # a message per step carries one id: `step`, its common case inline
            token_id = token_ids[0]
            text = self._token_texts[token_id] if not self._pending and token_id not in self._skipped else None
            if text is None:
                return self.step(token_id)
            self.text_offset += len(text)
            return text
        return self._take(b"".join(self._token_bytes[t] for t in token_ids if t not in self._skipped))

    def _take(self, data: bytes) -> str:
        """Emit the pending bytes and `data`, holding back only a proper prefix of a character."""
        buf = self._pending + data
        keep = _incomplete_tail(buf)
        self._pending = buf[len(buf) - keep :] if keep else b""
        return self._emit(buf[: len(buf) - keep])

    def flush(self) -> str:
        """End of stream: held-back bytes as U+FFFD ('' if none)."""
        buf, self._pending = self._pending, b""
        return self._emit(buf)

    def _emit(self, data: bytes) -> str:
        text = data.decode("utf-8", errors="replace")
        self.text_offset += len(text)
        return text
