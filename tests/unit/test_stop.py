"""Stop strings across arbitrary text boundaries."""

from __future__ import annotations

import itertools

from hypothesis import given
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
    return out + matcher.flush(), False


def test_every_split_of_a_stop_string():
    before, stop, after = "The answer is 4", "\n\nUser:", " more"
    text = before + stop + after
    for pieces in splits(text[len(before) - 3 : len(before) + len(stop) + 2]):
        out, matched = feed(StopMatcher([stop, "zzz"]), [before[:-3], *pieces, after])
        assert matched and out == before


@given(st.text(alphabet="ab\n", max_size=30), st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3), st.data())
def test_matches_the_offline_cut(text, stops, data):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, matched = feed(StopMatcher(stops), pieces)
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        assert matched and out == text[:first]
    else:
        assert not matched and out == text  # held-back text is released at the end


def test_no_stops_passes_through():
    assert StopMatcher([]).push("abc") == ("abc", False)
