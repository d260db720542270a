"""`serve`'s supervision of its worker processes: restart on exit with backoff, give up after a burst.

A worker that exits is started again after `restart_backoff_s`, doubled for
each restart within the last `restart_window_s` (capped at
`restart_backoff_max_s`). One that has been restarted `max_restarts` times
within the window and exits again stays down: the reason (exit code or
signal, and its last error) is printed and exported as metrics
(`hybridgate:worker_restarts_total{worker}`, `hybridgate:worker_up{worker}`).
Once every worker stays down, `run()` returns and `serve` exits non-zero with
their last errors (`gave_up()`): a gateway that can never serve again must not
answer 503 forever; while another worker serves, `serve` stays up.
The restarted worker binds the same ipc path, so the gateway's client finds
it by probing; its new boot id tells the client it is a new worker.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybridgate.config import environment
from hybridgate.run.config import SupervisorConfig
from hybridgate.workers.config import WorkerConfig

# Test-only: a worker started with this variable set to 1 raises at once, so the tests can
# watch the supervisor give up. Never set it in production.
CRASH_AT_START_ENV = "HYBRIDGATE_TEST_CRASH_AT_START"
POLL_S = 0.05


def worker_main(config: WorkerConfig, error_path: str) -> None:
    """Entry of a supervised worker process: the worker, with its last error written to `error_path`."""
    try:
        if environment(CRASH_AT_START_ENV) == "1":
            raise RuntimeError(f"crashing at start as {CRASH_AT_START_ENV}=1 asks (a test-only setting)")
        from hybridgate.workers.process import run_worker  # in the worker process only

        run_worker(config)
    except BaseException as exc:
        Path(error_path).write_text(f"{type(exc).__name__}: {exc}")
        raise


def exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass
class WorkerSlot:
    """One supervised worker: its process now, and its restart history."""

    name: str
    config: WorkerConfig
    error_path: Path
    proc: multiprocessing.Process | None = None
    restarts: deque = field(default_factory=deque)  # monotonic times of the restarts within the window
    restarts_total: int = 0
    start_at: float | None = None  # a restart is due then
    given_up: bool = False
    reason: str = ""  # why it last exited

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.is_alive()


class Supervisor:
    """Starts `configs` as processes and keeps them running (call `poll` often, or run `run()`).

    Also a Prometheus collector (register it on the gateway's registry).
    """

    def __init__(self, configs: dict[str, WorkerConfig], config: SupervisorConfig, error_dir: str | Path):
        self.config = config
        self.slots = [WorkerSlot(name, c, Path(error_dir, f"{name}.error")) for name, c in configs.items()]
        self.stopping = False
        self.on_exit: Callable[[str, str], None] = lambda name, reason: None  # e.g. tell the router's client

    def start_all(self) -> None:
        for slot in self.slots:
            self._start(slot)

    async def run(self) -> None:
        """Poll until stopped, or until every worker has been given up on (see `gave_up`)."""
        while not self.stopping and not self.gave_up():
            self.poll(time.monotonic())
            await asyncio.sleep(POLL_S)

    def gave_up(self) -> str | None:
        """Once every worker stays down after its restarts: one line naming each and why it last exited
        (its exit code or signal and last error); None while any worker runs or will be restarted."""
        if not self.slots or not all(slot.given_up for slot in self.slots):
            return None
        return "; ".join(f"worker {slot.name}: {slot.reason}" for slot in self.slots)

    def poll(self, now: float) -> None:
        if self.stopping:
            return
        for slot in self.slots:
            if slot.proc is not None and not slot.proc.is_alive():
                self._exited(slot, now)
            if slot.start_at is not None and now >= slot.start_at:
                slot.start_at = None
                slot.restarts_total += 1
                self._start(slot)

    def _exited(self, slot: WorkerSlot, now: float) -> None:
        pid, code = slot.proc.pid, slot.proc.exitcode
        slot.proc = None
        error = slot.error_path.read_text().strip() if slot.error_path.exists() else ""
        slot.reason = exit_reason(code) + (f"; last error: {error}" if error else "")
        self.on_exit(slot.name, slot.reason)
        window = self.config.restart_window_s
        while slot.restarts and now - slot.restarts[0] > window:
            slot.restarts.popleft()
        if len(slot.restarts) >= self.config.max_restarts:
            slot.given_up = True
            _say(f"worker {slot.name} (pid {pid}) exited ({slot.reason}) after {len(slot.restarts)} restarts within "
                 f"{window:g} s; not restarting it (--worker-max-restarts)")
            return
        delay = min(self.config.restart_backoff_s * 2 ** len(slot.restarts), self.config.restart_backoff_max_s)
        slot.restarts.append(now + delay)
        slot.start_at = now + delay
        _say(f"worker {slot.name} (pid {pid}) exited ({slot.reason}); restarting it in {delay:g} s")

    def _start(self, slot: WorkerSlot) -> None:
        endpoint = slot.config.endpoint
        if endpoint.startswith("ipc://"):  # the dead worker's socket file: bind the same path afresh
            Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
        slot.error_path.unlink(missing_ok=True)
        proc = multiprocessing.get_context("spawn").Process(
            target=worker_main, args=(slot.config, str(slot.error_path)), name=f"hybridgate-worker-{slot.name}")
        proc.daemon = True
        proc.start()
        slot.proc = proc

    def stop_all(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every worker, SIGKILL what is left after `timeout_s`; no restarts from now on."""
        self.stopping = True
        procs = [s.proc for s in self.slots if s.proc is not None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def collect(self):
        restarts = CounterMetricFamily("hybridgate:worker_restarts", "Restarts of a worker process by serve.",
                                       labels=["worker"])
        up = GaugeMetricFamily("hybridgate:worker_up", "1 while the worker's process runs, 0 while it is down.",
                               labels=["worker"])
        for slot in self.slots:
            restarts.add_metric([slot.name], slot.restarts_total)
            up.add_metric([slot.name], 1 if slot.up else 0)
        yield from (restarts, up)


def _say(line: str) -> None:
    print(f"hybridgate: {line}", file=sys.stderr, flush=True)
