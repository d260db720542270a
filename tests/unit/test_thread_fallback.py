"""The measured fallback to fewer kernel threads, driven with step times made up per thread count. The
expected schedules are worked by hand from the rule in `threadfallback`'s docstring (a first trial after
3 decode steps, then every 2 s, doubled after a trial that changed nothing; 3 probe steps; switch when
their median is under 0.9 x the current one; a probe step over twice that ends the trial); the step
times are binary fractions so the clock adds up exactly."""

from __future__ import annotations

import logging

import pytest

from hybridgate.workers.cpu.threadfallback import ThreadFallback, ladder


def drive(fallback: ThreadFallback, seconds: dict[int, float], steps: int, batch: int | None = 1,
          now: float = 0.0) -> tuple[list[int], float]:
    """Run `steps` steps, each taking `seconds[threads]`; the thread counts chosen, and the clock after."""
    counts = []
    for _ in range(steps):
        threads = fallback.threads_for(batch, now)
        now += seconds[threads]
        fallback.record(threads, batch, seconds[threads], now)
        counts.append(threads)
    return counts, now


@pytest.mark.parametrize(("threads", "counts"), [(16, [16, 8, 4, 2, 1]), (3, [3, 1]), (1, [1])])
def test_the_ladder_halves_down_to_one_thread(threads, counts):
    assert ladder(threads) == counts


def test_a_busy_core_moves_decode_to_one_thread_and_trials_upward_cost_one_step_each():
    fallback = ThreadFallback(2)
    counts, _ = drive(fallback, {2: 0.125, 1: 0.03125}, 3 + 3 + 64 + 1 + 128 + 1 + 5)
    # The first trial follows the first 3 steps; one thread wins (31 ms < 0.9 x 125 ms) at 0.46875 s.
    # 2 s later (64 steps of 31.25 ms) a trial upward: its first step, 125 ms, is over twice 31.25 ms,
    # so it ends there and the wait doubles to 4 s (128 steps); the next trial (downward: none, so
    # upward again) ends the same way.
    assert counts == [2] * 3 + [1] * 3 + [1] * 64 + [2] + [1] * 128 + [2] + [1] * 5
    assert fallback.current == 1 and fallback.switches == 1


def test_a_costly_trial_waits_twenty_times_what_it_lost():
    fallback = ThreadFallback(2)
    counts, _ = drive(fallback, {2: 4.0, 1: 0.03125}, 3 + 3 + 64 + 1 + 2540 + 1)
    # The trial upward lost 4 - 0.03125 = 3.96875 s: the next waits 79.375 s, 2,540 steps of 31.25 ms.
    assert counts == [2] * 3 + [1] * 3 + [1] * 64 + [2] + [1] * 2540 + [2]


def test_an_idle_machine_keeps_every_thread_and_probes_ever_more_rarely():
    fallback = ThreadFallback(2)
    counts, _ = drive(fallback, {2: 0.0625, 1: 0.1875}, 3 + 1 + 64 + 1 + 3)
    # One thread's first step (187.5 ms) is over twice 62.5 ms: each trial costs one step, then the
    # wait doubles: 4 s (64 steps), then 8 s.
    assert counts == [2] * 3 + [1] + [2] * 64 + [1] + [2] * 3
    assert fallback.current == 2 and fallback.switches == 0


def test_the_load_going_away_brings_the_threads_back(caplog):
    fallback = ThreadFallback(2)
    caplog.set_level(logging.DEBUG, "hybridgate.worker")
    _, now = drive(fallback, {2: 0.125, 1: 0.03125}, 6)
    assert fallback.current == 1 and now == 0.46875
    # The other process ends: two threads now take 15.625 ms against 31.25 ms. The next trial, upward,
    # starts 2 s after the first ended: 64 steps from here; its three steps win.
    counts, _ = drive(fallback, {2: 0.015625, 1: 0.03125}, 64 + 3 + 2, now=now)
    assert counts == [1] * 64 + [2] * 3 + [2] * 2
    assert fallback.current == 2 and fallback.switches == 2
    # the first move at INFO with its reason; the next, as a busy neighbour comes and goes, at DEBUG
    moves = [(r.levelno, "slowest thread" in r.getMessage()) for r in caplog.records]
    assert moves == [(logging.INFO, True), (logging.DEBUG, False)], moves


def test_a_neighbour_only_slightly_faster_is_not_taken():
    fallback = ThreadFallback(2)
    counts, _ = drive(fallback, {2: 0.125, 1: 0.1171875}, 40)  # 0.9375 x: inside the 0.9 margin
    assert counts[:7] == [2] * 3 + [1] * 3 + [2]
    assert fallback.current == 2 and fallback.switches == 0


def test_prompt_steps_run_on_the_current_count_and_a_batch_change_ends_a_trial():
    fallback = ThreadFallback(4)
    _, now = drive(fallback, {4: 0.125, 2: 0.03125}, 3)
    assert fallback.threads_for(1, now) == 2  # the trial began
    assert fallback.threads_for(None, now) == 4  # a prompt step: the current count
    assert fallback.threads_for(3, now) == 4  # another batch size: the trial ends undecided
    assert fallback.threads_for(1, now) == 4 and fallback.current == 4 and fallback.switches == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="threads >= 1"):
        ThreadFallback(0)
