"""A JSON string's text out of its raw fragments, as far as it is certain (RFC 8259, section 7: escapes and
UTF-16 surrogate pairs); `toolparse` decodes the string values of streamed tool calls with it."""

from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder(strict=False)  # a model may write raw control characters inside strings


class StringDecoder:
    """A JSON string's raw text (the quotes included) in fragments -> its decoded text, as far as it is certain.

    An escape cut by a fragment boundary (`\\`, `\\u00`, a high surrogate waiting for its low half) is
    held until the next fragment; what cannot be decoded is passed through as written."""

    def __init__(self) -> None:
        self._raw = ""
        self._opened = False

    def push(self, raw: str, closed: bool = False) -> str:
        if not self._opened:
            raw, self._opened = raw[1:], True  # the opening quote
        text = self._raw + raw
        if closed:
            text, self._raw = (text[:-1] if text.endswith('"') else text), ""
            return decode_raw(text)
        cut = _safe_end(text)
        self._raw = text[cut:]
        return decode_raw(text[:cut])


_HIGH_SURROGATE_END = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


def _safe_end(raw: str) -> int:
    """The length of `raw`'s longest prefix that ends on a whole escape and not on a high surrogate
    waiting for its low half (an escape is at most 6 characters, a surrogate pair 12)."""
    k = raw.rfind("\\", max(0, len(raw) - 12))
    if k < 0:
        return len(raw)
    run = k - len(raw[:k].rstrip("\\"))  # backslashes just before this one
    if run % 2 == 1:  # this one is the second of an escaped backslash: everything is whole
        return len(raw)
    tail = raw[k:]
    if len(tail) == 1 or (tail[1] == "u" and len(tail) < 6):
        cut = k
    elif tail[1] == "u" and _HIGH_SURROGATE_END.search(tail[:6]) and len(tail) == 6:
        cut = k
    else:
        return len(raw)
    if _HIGH_SURROGATE_END.search(raw[:cut]):
        cut -= 6
    return cut


def decode_raw(raw: str) -> str:
    """The text of a JSON string's raw inside (no quotes), or `raw` as written when it does not decode."""
    if "\\" not in raw:
        return raw
    try:
        return _DECODER.decode('"' + raw + '"')
    except ValueError:
        return raw
