"""Stop strings across arbitrary text boundaries."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.router.stop import StopMatcher


def splits(text: str):
    """Every way to cut `text` into non-empty pieces."""
    for cuts in itertools.product([False, True], repeat=len(text) - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append(text[start:i])
                start = i
        yield pieces + [text[start:]]


def feed(matcher: StopMatcher, pieces) -> tuple[str, bool]:
    out = ""
    for p in pieces:
        emitted, matched = matcher.push(p)
        out += emitted
        if matched:
            return out, True
    rest, matched = matcher.flush()
    return out + rest, matched


def test_every_split_of_a_stop_string():
    before, stop, after = "The answer is 4", "\n\nUser:", " more"
    text = before + stop + after
    for pieces in splits(text[len(before) - 3 : len(before) + len(stop) + 2]):
        out, matched = feed(StopMatcher([stop, "zzz"]), [before[:-3], *pieces, after])
        assert matched and out == before


def reference(text: str, stops) -> tuple[str, bool]:
    """The spec on the whole text at once: cut where the earliest stop string starts."""
    for i in range(len(text)):
        if any(s and text[i : i + len(s)] == s for s in stops):
            return text[:i], True
    return text, False


def test_earliest_start_wins_however_the_text_is_cut():
    # hypothesis found this: cut as "\n", "a", "a", the "a" at 1 used to win over "\naa" at 0.
    for pieces in splits("\naa"):
        assert feed(StopMatcher(["a", "\naa"]), pieces) == ("", True)
    for pieces in splits("\naab"):
        assert feed(StopMatcher(["a", "\naaa"]), pieces) == ("\n", True)
    for pieces in splits("\na"):  # the stream ends while "\naa" could still complete: "a" cuts it
        assert feed(StopMatcher(["a", "\naa"]), pieces) == ("\n", True)


PIECES = st.text(alphabet="ab\n", min_size=1, max_size=4)


@settings(max_examples=500)  # cheap examples (a few seconds in all): search harder than the default 100
@given(st.text(alphabet="ab\n", max_size=30), st.lists(PIECES, min_size=1, max_size=3), st.data())
def test_any_cut_matches_the_one_piece_reference(text, stops, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    # feed() ends with flush(), as a stream that ends by EOS or length does.
    assert feed(StopMatcher(stops), pieces) == reference(text, stops)


def test_no_stops_passes_through():
    assert StopMatcher([]).push("abc") == ("abc", False)
