"""The measured fallback to fewer kernel threads, driven with step times made up per thread count. The
expected schedules are worked by hand from the rule in `threadfallback`'s docstring (trials every 2 s
of decode steps, 3 probe steps, switch when the probe's median is under 0.9 x the current one); the
step times are binary fractions so the clock adds up exactly."""

from __future__ import annotations

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


def test_a_busy_core_moves_decode_to_one_thread_and_a_trial_upward_keeps_it_there():
    fallback = ThreadFallback(2)
    counts, _ = drive(fallback, {2: 0.125, 1: 0.03125}, 17 + 3 + 64 + 3 + 5)
    # First period from the end of step 1 (0.125 s): the trial starts at 2.125 s, step 17; one thread
    # wins (31 ms < 0.9 x 125 ms). The next period runs from 2.21875 s: 64 steps of 31.25 ms, then
    # a trial upward on two threads loses.
    assert counts == [2] * 17 + [1] * 3 + [1] * 64 + [2] * 3 + [1] * 5
    assert fallback.current == 1 and fallback.switches == 1


def test_an_idle_machine_keeps_every_thread_and_probes_one_thread_briefly():
    fallback = ThreadFallback(2)
    counts, _ = drive(fallback, {2: 0.0625, 1: 0.125}, 33 + 3 + 32 + 3)
    # Trials at 2.0625 s (step 33) and 2 s after the first one ended: 3 steps in 71 on one thread.
    assert counts == [2] * 33 + [1] * 3 + [2] * 32 + [1] * 3
    assert fallback.current == 2 and fallback.switches == 0


def test_the_load_going_away_brings_the_threads_back():
    fallback = ThreadFallback(2)
    _, now = drive(fallback, {2: 0.125, 1: 0.03125}, 20)
    assert fallback.current == 1
    # The other process ends: two threads now take 15.625 ms against 31.25 ms. The next trial is
    # upward; it starts once 2 s passed since the first ended (at 2.21875 s): step 64 from here.
    counts, _ = drive(fallback, {2: 0.015625, 1: 0.03125}, 64 + 3 + 2, now=now)
    assert counts == [1] * 64 + [2] * 3 + [2] * 2
    assert fallback.current == 2 and fallback.switches == 2


def test_a_neighbour_only_slightly_faster_is_not_taken():
    fallback = ThreadFallback(2)
    drive(fallback, {2: 0.125, 1: 0.1171875}, 40)  # 0.9375 x: inside the 0.9 margin
    assert fallback.current == 2 and fallback.switches == 0


def test_prompt_steps_run_on_the_current_count_and_a_batch_change_ends_a_trial():
    fallback = ThreadFallback(4)
    _, now = drive(fallback, {4: 0.125, 2: 0.03125}, 17)
    assert fallback.threads_for(1, now) == 2  # the trial began
    assert fallback.threads_for(None, now) == 4  # a prompt step: the current count
    assert fallback.threads_for(3, now) == 4  # another batch size: the trial ends undecided
    assert fallback.threads_for(1, now) == 4 and fallback.current == 4 and fallback.switches == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="threads >= 1"):
        ThreadFallback(0)
