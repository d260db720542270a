"""Admission's count and its retry pushback, on a fake clock, against hand-computed values."""

from __future__ import annotations

import pytest

from hybridgate.gateway.admission import MAX_MS, START_MS, Admission


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_limit_counts_requests_in_flight():
    a = Admission(2, clock=Clock())
    assert a.try_enter(8) and a.try_enter(8)
    assert not a.try_enter(8)
    a.leave(8)
    assert a.try_enter(8) and a.inflight == 2


def test_nothing_measured_yet_gives_the_start_value():
    a = Admission(1, clock=Clock())
    a.try_enter(8)
    assert not a.try_enter(8)
    assert a.pushback_ms() == START_MS


def test_pushback_from_the_token_rate_before_any_completion():
    clock = Clock()
    a = Admission(2, clock=clock)
    a.try_enter(10), a.try_enter(30)  # mean max_tokens 20
    for _ in range(11):  # 10 ids counted over 1 s (the first sample opens the span): 10 tokens/s
        a.streamed(1)
        clock.t += 0.1
    clock.t -= 0.1
    # 10 tokens/s / 20 tokens per request = 0.5 requests/s: a slot in 2 s
    assert not a.try_enter(8)
    assert a.pushback_ms() == 2000


def test_pushback_from_the_completions_and_the_callers_ahead():
    clock = Clock()
    a = Admission(4, clock=clock)
    for _ in range(4):
        a.try_enter(8)
    for _ in range(3):  # completions 0.25 s apart: 4 requests/s
        a.leave(8)
        a.try_enter(8)
        clock.t += 0.25
    assert not a.try_enter(8)
    assert a.pushback_ms() == 250
    assert not a.try_enter(8)  # a second caller refused within the interval waits for the second slot
    assert a.pushback_ms() == 500
    clock.t += 1.0  # those refusals are old now
    assert not a.try_enter(8)
    assert a.pushback_ms() == 250


def test_pushback_is_bounded():
    clock = Clock()
    a = Admission(1, clock=clock)
    a.try_enter(8)
    a.leave(8)
    clock.t += 1000.0
    a.try_enter(8)
    a.leave(8)
    a.try_enter(8)
    assert not a.try_enter(8)
    assert a.pushback_ms() == MAX_MS


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="max_inflight_requests: must be >= 1, got 0"):
        Admission(0)


def test_the_token_rate_from_the_times_the_door_hands_over():
    clock = Clock()  # stays put: the times handed to streamed() are the ones that count
    a = Admission(2, clock=clock)
    a.try_enter(10), a.try_enter(30)
    for k in range(11):  # as in the test above: 10 tokens/s, 20 tokens per request, a slot in 2 s
        a.streamed(1, now=k * 0.1)
    assert not a.try_enter(8)
    assert a.pushback_ms() == 2000
