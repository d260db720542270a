"""A measured fallback to fewer kernel threads when the cores are shared.

A step's parallel regions end at a barrier, so a step runs at the pace of its
slowest thread: on a core that other processes keep busy, each region waits
for that thread's next time slice, and with over a hundred regions a step
every core can slow a decode many times over (a step on one thread has no
barrier to wait at). Which count is faster depends on the load of the moment,
so it is measured: the runner times its decode-only steps, and once `probe`
of them ran (then every `period_s` seconds, doubled after each trial that
changed nothing, up to 16 times, and at least 20 times the time the last
trial lost, so probing costs at most about 5%) the next `probe` decode steps of the same
batch size run on a neighbouring count of the ladder (the configured threads,
halved down to one), alternately the one below and the one above. The
neighbour becomes the count when the median of its steps is below `margin`
times the median of the `probe` steps just before it; a trial step slower
than twice that median ends the trial at once (a trial on a taken core costs
one step), and a change of batch size ends it undecided. Prompt steps always
run on the current count and take no part. The kernels give bitwise the same logits on any count, so a
switch changes no output.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger("hybridgate.worker")


def ladder(threads: int) -> list[int]:
    """The counts tried: `threads`, then halved down to 1 (e.g. 16, 8, 4, 2, 1)."""
    counts = [threads]
    while counts[-1] > 1:
        counts.append(counts[-1] // 2)
    return counts


class ThreadFallback:
    """Chooses the kernel threads of each step (`threads_for`) from the steps' measured times (`record`).

    Times are seconds (`time.monotonic()` for `now`, step durations for `seconds`); `decode_batch` is
    the step's sequence count for a decode-only step and None for any other step.
    """

    def __init__(self, threads: int, period_s: float = 2.0, probe: int = 3, margin: float = 0.9):
        if threads < 1 or probe < 1 or not 0 < margin <= 1:
            raise ValueError(f"ThreadFallback: threads >= 1, probe >= 1 and margin in (0, 1] (got {threads}, "
                             f"{probe}, {margin})")
        self.ladder, self.current = ladder(threads), threads
        self.period_s, self.probe, self.margin = period_s, probe, margin
        self.switches = 0
        self._recent: deque[tuple[int, float]] = deque(maxlen=probe)  # (batch, seconds) on the current count
        self._last_trial: float | None = None  # when the last trial ended (None: none yet)
        self._wait = period_s  # seconds from one trial to the next
        self._trial: tuple[int, int, list[float], list[float]] | None = None  # (threads, batch, reference, times)
        self._down = True  # the next trial's direction

    def threads_for(self, decode_batch: int | None, now: float) -> int:
        """The thread count of the next step."""
        if decode_batch is None:
            return self.current
        if self._trial is None and self._due(decode_batch, now):
            self._trial = (self._neighbour(), decode_batch, [s for _, s in self._recent], [])
        if self._trial is not None and self._trial[1] != decode_batch:
            self._trial, self._last_trial = None, now  # the batch changed: its times would not compare
        return self._trial[0] if self._trial is not None else self.current

    def record(self, threads: int, decode_batch: int | None, seconds: float, now: float) -> None:
        """A step ran on `threads` in `seconds`."""
        if decode_batch is None:
            return
        if self._trial is None or threads != self._trial[0]:
            self._recent.append((decode_batch, seconds))
            return
        count, _, reference, times = self._trial
        times.append(seconds)
        mine = statistics.median(reference)
        if len(times) < self.probe and seconds <= 2 * mine:
            return
        theirs = statistics.median(times)
        if len(times) == self.probe and theirs < self.margin * mine:
            # the first move at INFO with why; the later ones (a busy neighbour comes and goes) at DEBUG
            log.log(logging.DEBUG if self.switches else logging.INFO,
                    "CPU runner: decode steps ran in %.1f ms on %d threads against %.1f ms on %d; using %d%s",
                    theirs * 1e3, count, mine * 1e3, self.current, count, "" if self.switches else
                    " (a step waits for its slowest thread, and other processes share these cores; the count is "
                    "measured again every few seconds, later moves logged at DEBUG; --no-cpu-thread-fallback "
                    "keeps --threads)")
            self.current, self.switches, self._wait = count, self.switches + 1, self.period_s
            self._recent.clear()
        else:  # probing costs at most about 5% of the time: wait 20 times what the trial lost
            lost = sum(times) - len(times) * mine
            self._wait = max(min(2 * self._wait, 16 * self.period_s), 20 * lost)
        self._trial, self._last_trial, self._down = None, now, not self._down

    def _due(self, batch: int, now: float) -> bool:
        waited = self._last_trial is None or now - self._last_trial >= self._wait
        return (len(self.ladder) > 1 and waited and len(self._recent) == self.probe
                and all(b == batch for b, _ in self._recent))

    def _neighbour(self) -> int:
        i = self.ladder.index(self.current)
        below = self.ladder[i + 1] if i + 1 < len(self.ladder) else None
        above = self.ladder[i - 1] if i > 0 else None
        if self._down:
            return below if below is not None else above
        return above if above is not None else below
